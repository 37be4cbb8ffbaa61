//! Whose key it is: see [`Principal`] and [`Scope`].

use std::{fmt, sync::Arc};

use http::request::Parts;
use sha2::{Digest, Sha256};

use crate::key::IdempotencyKey;

/// The authenticated account a request acts for: the owner of its idempotency keys. Insert one
/// into the request extensions from the authentication layer:
///
/// ```
/// use axum::{Router, routing::post, middleware::{self, Next}, extract::Request};
/// use axum::{http::StatusCode, response::Response};
/// use tower_idempotency::{IdempotencyLayer, Principal};
///
/// async fn authenticate(mut request: Request, next: Next) -> Result<Response, StatusCode> {
///     // A real app checks the credential and finds the account here.
///     let principal = Principal::new("acct_123").map_err(|_| StatusCode::UNAUTHORIZED)?;
///     request.extensions_mut().insert(principal);
///     Ok(next.run(request).await)
/// }
///
/// let app: Router = Router::new()
///     .route("/v1/charges", post(|| async { "charged" }))
///     .layer(IdempotencyLayer::memory())
///     // Outermost: runs first, so the principal is there when the idempotency layer looks.
///     .layer(middleware::from_fn(authenticate));
/// ```
///
/// A key is only meaningful for the client that made it up. The record the layer stores is
/// addressed by a [`ScopeKey`]: the SHA-256 of the **principal**, the method, the path and the
/// key, so one tenant's `Idempotency-Key: 1` never meets another's, the same key on two endpoints
/// names two operations, and neither principals nor raw keys reach the store in clear.
///
/// The principal comes from the application's authentication, which runs *before* this layer
/// (in axum, a layer added *after* this one with `.layer(...)`) and inserts a [`Principal`] into
/// the request extensions. Keying on the authenticated account rather than on a credential means
/// a retry made after a token refresh still finds its record.
///
/// **No principal, no service.** When a covered request carries an `Idempotency-Key` but the
/// [`Scope`] finds no principal, the layer does not guess: sharing one scope between everyone who
/// is unauthenticated would let one client replay another's response. It answers `500` with a
/// problem body naming the misconfiguration (usually the authentication layer sits inside this
/// one instead of outside it), runs nothing and stores nothing. An application that really has a
/// single tenant says so with [`Scope::single_tenant`].
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Principal(Arc<str>);

impl Principal {
    /// A principal from a stable account identifier (not a token that rotates).
    ///
    /// # Errors
    ///
    /// [`EmptyPrincipal`] when `id` is empty or only whitespace: an authentication layer that
    /// found no account must not hand every such request one shared scope.
    pub fn new(id: impl Into<Arc<str>>) -> Result<Self, EmptyPrincipal> {
        let id = id.into();
        if id.trim().is_empty() {
            return Err(EmptyPrincipal);
        }
        Ok(Self(id))
    }

    /// The one principal of [`Scope::single_tenant`]: empty, which no [`Principal::new`] is.
    fn single_tenant() -> Self {
        Self(Arc::from(""))
    }

    /// The identifier.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// [`Principal::new`] was given an empty or blank identifier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmptyPrincipal;

impl fmt::Display for EmptyPrincipal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            "a principal needs a non-empty account identifier; a request whose account is \
             unknown must get no principal (the layer then refuses its key)",
        )
    }
}

impl std::error::Error for EmptyPrincipal {}

impl fmt::Debug for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Principal").field(&self.0).finish()
    }
}

/// Where the layer finds the [`Principal`] of a request, and how far a key reaches; set with
/// [`IdempotencyLayer::with_scope`](crate::IdempotencyLayer::with_scope).
///
/// # One key per endpoint, or per principal
///
/// By default a key is scoped to its principal **and endpoint** (method and path): the same key
/// sent to another endpoint names another operation and runs. That suits clients that make up
/// keys per endpoint, or reuse a key for the steps of one workflow (`POST /orders` then
/// `POST /orders/1/pay`).
///
/// [`across_endpoints`](Self::across_endpoints) scopes keys to the principal alone, with the
/// method and path in the fingerprint instead: a key reused on another endpoint is then a `422`
/// mismatch, as Stripe's API answers. Choose it when keys identify one operation whatever the
/// endpoint (a UUID per call, as payment SDKs make), so that a client bug sending one key to two
/// endpoints is caught rather than run twice.
#[derive(Clone, Default)]
pub struct Scope {
    source: ScopeSource,
    across_endpoints: bool,
}

type PrincipalFn = dyn Fn(&Parts) -> Option<Principal> + Send + Sync;

#[derive(Clone, Default)]
enum ScopeSource {
    #[default]
    Extension,
    SingleTenant,
    Custom(Arc<PrincipalFn>),
}

impl Scope {
    /// The default: the [`Principal`] in the request extensions, put there by the app's
    /// authentication layer. A request without one is refused (see the
    /// [`Principal`]).
    pub fn principal_extension() -> Self {
        Self::default()
    }

    /// Every request belongs to the same principal. Only for applications with a single tenant
    /// (or none): every client shares one key space.
    pub fn single_tenant() -> Self {
        Self {
            source: ScopeSource::SingleTenant,
            across_endpoints: false,
        }
    }

    /// A principal derived from the request head by `f`, for apps whose authentication leaves
    /// something other than a [`Principal`] behind. `None` refuses the request as a missing
    /// principal does.
    ///
    /// For example, an authentication layer that leaves its verified token claims in the
    /// request extensions: the keys belong to the claims' subject (the account), which stays
    /// the same when the token is refreshed.
    ///
    /// ```
    /// use axum::{Router, body::Body, http::Request, routing::post};
    /// use tower::ServiceExt;
    /// use tower_idempotency::{IdempotencyLayer, Principal, Scope};
    ///
    /// /// What the app's JWT middleware inserts once it has verified a token.
    /// #[derive(Clone)]
    /// struct Claims {
    ///     sub: String,
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let app = Router::new()
    ///     .route("/v1/orders", post(|| async { "placed" }))
    ///     .layer(IdempotencyLayer::memory().with_scope(Scope::from_fn(|parts| {
    ///         let claims = parts.extensions.get::<Claims>()?;
    ///         Principal::new(claims.sub.as_str()).ok()
    ///     })));
    ///
    /// // Standing in for the JWT middleware: a request as `sub` sends it.
    /// let order = |sub: &str| {
    ///     let mut request = Request::post("/v1/orders")
    ///         .header("idempotency-key", "order-1")
    ///         .body(Body::empty())
    ///         .unwrap();
    ///     request.extensions_mut().insert(Claims { sub: sub.into() });
    ///     request
    /// };
    /// let alice = app.clone().oneshot(order("user_alice")).await.unwrap();
    /// let bob = app.clone().oneshot(order("user_bob")).await.unwrap();
    /// let alice_again = app.oneshot(order("user_alice")).await.unwrap();
    /// // The same key, two accounts: each its own run; the first account's retry is a replay.
    /// assert!(alice.headers().get("idempotent-replayed").is_none());
    /// assert!(bob.headers().get("idempotent-replayed").is_none());
    /// assert_eq!(alice_again.headers()["idempotent-replayed"], "true");
    /// # }
    /// ```
    pub fn from_fn<F>(f: F) -> Self
    where
        F: Fn(&Parts) -> Option<Principal> + Send + Sync + 'static,
    {
        Self {
            source: ScopeSource::Custom(Arc::new(f)),
            across_endpoints: false,
        }
    }

    /// One key per principal across every endpoint, instead of one per endpoint: see
    /// [above](#one-key-per-endpoint-or-per-principal).
    #[must_use]
    pub fn across_endpoints(mut self) -> Self {
        self.across_endpoints = true;
        self
    }

    /// Whether a key reaches across endpoints.
    pub fn is_across_endpoints(&self) -> bool {
        self.across_endpoints
    }

    /// The record key of `key` sent by `principal` to `method` `path`, as this scope reaches.
    pub(crate) fn key(
        &self,
        principal: &Principal,
        method: &http::Method,
        path: &str,
        key: &IdempotencyKey,
    ) -> ScopeKey {
        if self.across_endpoints {
            ScopeKey::for_principal(principal, key)
        } else {
            ScopeKey::new(principal, method, path, key)
        }
    }

    pub(crate) fn principal(&self, parts: &Parts) -> Option<Principal> {
        match &self.source {
            ScopeSource::Extension => parts.extensions.get::<Principal>().cloned(),
            ScopeSource::SingleTenant => Some(Principal::single_tenant()),
            ScopeSource::Custom(f) => f(parts),
        }
    }
}

impl fmt::Debug for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.source {
            ScopeSource::Extension => "Scope::principal_extension()",
            ScopeSource::SingleTenant => "Scope::single_tenant()",
            ScopeSource::Custom(_) => "Scope::from_fn(..)",
        })?;
        if self.across_endpoints {
            f.write_str(".across_endpoints()")?;
        }
        Ok(())
    }
}

/// The address of a stored record: SHA-256 over principal, method, path and key.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ScopeKey([u8; 32]);

impl ScopeKey {
    /// Derives the record key of `key` sent by `principal` to `method` `path`.
    pub fn new(
        principal: &Principal,
        method: &http::Method,
        path: &str,
        key: &IdempotencyKey,
    ) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(b"tower-idempotency/scope/v1\0");
        for part in [
            principal.as_str().as_bytes(),
            method.as_str().as_bytes(),
            path.as_bytes(),
            key.as_str().as_bytes(),
        ] {
            // Length-prefixed, so ("ab", "c") and ("a", "bc") differ.
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part);
        }
        Self(hasher.finalize().into())
    }

    /// Derives the record key of `key` sent by `principal` to any endpoint (see
    /// [`Scope::across_endpoints`]).
    pub fn for_principal(principal: &Principal, key: &IdempotencyKey) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(b"tower-idempotency/scope/principal/v1\0");
        for part in [principal.as_str().as_bytes(), key.as_str().as_bytes()] {
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part);
        }
        Self(hasher.finalize().into())
    }

    /// Derives the record key of `key` under `scope` for [`Once`](crate::Once): its own
    /// domain, so no HTTP request's key can address it.
    pub(crate) fn off_request(scope: &str, key: &IdempotencyKey) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(b"tower-idempotency/scope/once/v1\0");
        for part in [scope.as_bytes(), key.as_str().as_bytes()] {
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part);
        }
        Self(hasher.finalize().into())
    }

    /// Rebuilds a key from its 32 bytes, as a store reads it back.
    ///
    /// The bytes should be those of a key [`new`](Self::new) made: stores may rely on them
    /// being a hash, uniformly spread, and keep only part of them (the PostgreSQL store keeps
    /// the first 128 bits), so made-up keys that share their first 16 bytes would be one key
    /// there.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The 32 bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

/// Lowercase hex: the form used in logs, safe to show (it reveals neither key nor principal).
impl fmt::Display for ScopeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for ScopeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ScopeKey({self})")
    }
}

#[cfg(test)]
mod tests {
    use http::{Method, Request};

    use super::*;

    fn key(k: &str) -> IdempotencyKey {
        IdempotencyKey::new(k).unwrap()
    }

    #[test]
    fn every_component_separates_scopes() {
        let a = Principal::new("acct_a").unwrap();
        let b = Principal::new("acct_b").unwrap();
        let base = ScopeKey::new(&a, &Method::POST, "/v1/charges", &key("k"));
        assert_ne!(
            base,
            ScopeKey::new(&b, &Method::POST, "/v1/charges", &key("k"))
        );
        assert_ne!(
            base,
            ScopeKey::new(&a, &Method::PATCH, "/v1/charges", &key("k"))
        );
        assert_ne!(
            base,
            ScopeKey::new(&a, &Method::POST, "/v1/refunds", &key("k"))
        );
        assert_ne!(
            base,
            ScopeKey::new(&a, &Method::POST, "/v1/charges", &key("k2"))
        );
        assert_eq!(
            base,
            ScopeKey::new(&a, &Method::POST, "/v1/charges", &key("k"))
        );
    }

    #[test]
    fn components_are_length_prefixed() {
        let ab = ScopeKey::new(
            &Principal::new("ab").unwrap(),
            &Method::POST,
            "/",
            &key("c"),
        );
        let a = ScopeKey::new(
            &Principal::new("a").unwrap(),
            &Method::POST,
            "/",
            &key("bc"),
        );
        assert_ne!(ab, a);
    }

    #[test]
    fn default_scope_needs_a_principal_extension() {
        let (mut parts, ()) = Request::new(()).into_parts();
        assert_eq!(Scope::default().principal(&parts), None);
        parts.extensions.insert(Principal::new("acct").unwrap());
        assert_eq!(
            Scope::default().principal(&parts),
            Some(Principal::new("acct").unwrap())
        );
    }

    /// The scope is the principal the authentication layer resolved, not the credential: a
    /// retry sent with a refreshed token for the same account is the same key's retry.
    #[test]
    fn a_refreshed_token_keeps_the_scope() {
        let key = IdempotencyKey::new("order-1").expect("key");
        let scope_of = |token: &str| {
            let (mut parts, ()) = Request::post("/v1/charges")
                .header(http::header::AUTHORIZATION, format!("Bearer {token}"))
                .body(())
                .unwrap()
                .into_parts();
            // What the app's authentication layer leaves: the account the token belongs to.
            parts.extensions.insert(Principal::new("acct_1").unwrap());
            let principal = Scope::default().principal(&parts).expect("principal");
            ScopeKey::new(&principal, &parts.method, parts.uri.path(), &key)
        };
        assert_eq!(
            scope_of("tok_before_refresh"),
            scope_of("tok_after_refresh")
        );
    }

    #[test]
    fn an_empty_principal_is_refused() {
        assert_eq!(Principal::new(""), Err(EmptyPrincipal));
        assert_eq!(Principal::new(" \t"), Err(EmptyPrincipal));
        assert_eq!(
            Principal::new("acct").map(|p| p.as_str().to_owned()),
            Ok("acct".into())
        );
        // The single-tenant scope is the one empty principal, so no account shares it.
        let (parts, ()) = Request::new(()).into_parts();
        let single = Scope::single_tenant().principal(&parts).unwrap();
        assert_ne!(single, Principal::new("x").unwrap());
        assert_eq!(single.as_str(), "");
    }

    #[test]
    fn single_tenant_and_custom_scopes() {
        let (parts, ()) = Request::builder()
            .header("x-tenant", "t1")
            .body(())
            .unwrap()
            .into_parts();
        assert!(Scope::single_tenant().principal(&parts).is_some());
        let custom = Scope::from_fn(|parts| {
            let tenant = parts.headers.get("x-tenant")?.to_str().ok()?;
            Principal::new(tenant).ok()
        });
        assert_eq!(
            custom.principal(&parts),
            Some(Principal::new("t1").unwrap())
        );
    }

    #[test]
    fn display_is_hex() {
        let k = ScopeKey::from_bytes([0xab; 32]);
        assert_eq!(k.to_string(), "ab".repeat(32));
    }
}
