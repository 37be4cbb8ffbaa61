//! The layer's contract in an app's OpenAPI document (feature `utoipa`): the IETF draft asks a
//! resource to publish its idempotency specification, expiry policy included.
//!
//! ```
//! use tower_idempotency::{IdempotencyLayer, KeySource};
//! use utoipa::openapi::{
//!     HttpMethod, OpenApiBuilder, PathItem, PathsBuilder, ResponseBuilder,
//!     path::OperationBuilder,
//! };
//!
//! let layer = IdempotencyLayer::memory().with_key(KeySource::default().required());
//! // The app's own document, from `#[derive(OpenApi)]` or built by hand.
//! let create = OperationBuilder::new()
//!     .response("200", ResponseBuilder::new().description("The charge"))
//!     .build();
//! let mut doc = OpenApiBuilder::new()
//!     .paths(PathsBuilder::new().path("/v1/charges", PathItem::new(HttpMethod::Post, create)))
//!     .build();
//!
//! layer.openapi().apply(&mut doc);
//!
//! let operation = doc.paths.paths["/v1/charges"].post.as_ref().unwrap();
//! let key = &operation.parameters.as_ref().unwrap()[0];
//! assert_eq!(key.name, "Idempotency-Key");
//! assert!(operation.responses.responses.contains_key("409"));
//! ```
//!
//! [`IdempotencyApi::apply`] adds to every operation of a method the layer covers (or, with
//! [`apply_to`](IdempotencyApi::apply_to), of the paths given):
//!
//! * the key's header parameter: its name, whether it is required, its limits (255 characters,
//!   `format: uuid` under [`KeyRule::uuid`](crate::KeyRule::uuid)), and a description saying how
//!   long a response is kept for replay (the TTL, in words) and how far a key reaches;
//! * the replay header (`Idempotent-Replayed`, or as [`Rendering`](crate::Rendering) names it) on
//!   each of the operation's responses, and
//!   `Idempotent-Replay-Body` (a replay whose body was too large to keep);
//! * the layer's refusals (`400`, `409`, `413`, `422`, `503`) with their problem schema
//!   (`IdempotencyProblem`, RFC 9457, with its `code` member), where the operation does not
//!   document that status itself;
//! * an `x-idempotency` extension with the same facts for tools: header, required, TTL in
//!   seconds, scope, the replay header's name, and each status's refusals by their `code`.
//!
//! An app that renders its refusals itself
//! ([`Rendering::custom`](crate::Rendering::custom)) gives their
//! schema with [`IdempotencyApi::with_refusal_schema`].

use std::time::Duration;

use utoipa::openapi::{
    ContentBuilder, Object, ObjectBuilder, OpenApi, RefOr, Required, ResponseBuilder, Schema, Type,
    extensions::Extensions,
    header::HeaderBuilder,
    path::{Operation, ParameterBuilder, ParameterIn},
    schema::SchemaFormat,
};

use crate::{
    key::header_title,
    problem::{PROBLEM_JSON, RejectionKind},
    replay::IDEMPOTENT_REPLAY_BODY,
    settings::{Config, MAX_DURATION},
};

/// The name of the refusals' schema in the document's components.
pub const PROBLEM_SCHEMA: &str = "IdempotencyProblem";

/// The facts of a layer's configuration that an OpenAPI document publishes; from
/// [`IdempotencyLayer::openapi`](crate::IdempotencyLayer::openapi).
#[derive(Clone)]
pub struct IdempotencyApi {
    header: Option<String>,
    required: bool,
    replayed: String,
    ttl: Duration,
    methods: Vec<http::Method>,
    across_endpoints: bool,
    rule: Option<(String, Option<&'static str>)>,
    refusal_schema: Option<RefOr<Schema>>,
    statuses: Vec<(RejectionKind, u16)>,
}

impl IdempotencyApi {
    pub(crate) fn new(config: &Config) -> Self {
        Self {
            header: config
                .key
                .header_name()
                .map(|name| header_title(name.as_str())),
            required: config.key.is_required(),
            replayed: header_title(config.rendering.replayed_header().as_str()),
            ttl: config.ttl,
            methods: config.methods.clone(),
            across_endpoints: config.scope.is_across_endpoints(),
            rule: config
                .key
                .rule()
                .map(|rule| (rule.name().to_owned(), rule.format())),
            refusal_schema: None,
            statuses: Vec::new(),
        }
    }

    /// The status an app that renders its refusals itself answers for `kind`, when it is not
    /// the layer's (a Stripe-compatible API answers a reused key with `400`, not `422`).
    #[must_use]
    pub fn with_refusal_status(mut self, kind: RejectionKind, status: u16) -> Self {
        self.statuses.retain(|(known, _)| *known != kind);
        self.statuses.push((kind, status));
        self
    }

    /// The status of `kind`'s refusals.
    fn status(&self, kind: RejectionKind) -> u16 {
        self.statuses
            .iter()
            .find(|(known, _)| *known == kind)
            .map_or(kind.status().as_u16(), |(_, status)| *status)
    }

    /// The schema of the refusals' bodies, for an app that renders them itself; by default
    /// `IdempotencyProblem`, an RFC 9457 problem document.
    #[must_use]
    pub fn with_refusal_schema(mut self, schema: impl Into<RefOr<Schema>>) -> Self {
        self.refusal_schema = Some(schema.into());
        self
    }

    /// Documents every operation of `doc` whose method the layer covers.
    pub fn apply(&self, doc: &mut OpenApi) {
        self.apply_where(doc, |_| true);
    }

    /// Documents the operations of the layer's methods on `paths` only: for a layer that wraps
    /// some routes of the app.
    pub fn apply_to<'a>(&self, doc: &mut OpenApi, paths: impl IntoIterator<Item = &'a str>) {
        let paths: Vec<&str> = paths.into_iter().collect();
        self.apply_where(doc, |path| paths.contains(&path));
    }

    fn apply_where(&self, doc: &mut OpenApi, covers_path: impl Fn(&str) -> bool) {
        if self.refusal_schema.is_none() {
            doc.components
                .get_or_insert_with(Default::default)
                .schemas
                .insert(PROBLEM_SCHEMA.to_owned(), problem_schema().into());
        }
        for (path, item) in doc.paths.paths.iter_mut() {
            if !covers_path(path) {
                continue;
            }
            let operations = [
                (http::Method::GET, &mut item.get),
                (http::Method::PUT, &mut item.put),
                (http::Method::POST, &mut item.post),
                (http::Method::DELETE, &mut item.delete),
                (http::Method::PATCH, &mut item.patch),
            ];
            for (method, operation) in operations {
                if let Some(operation) = operation
                    && self.methods.contains(&method)
                {
                    self.document(operation);
                }
            }
        }
    }

    /// The key's policy in words, for a description.
    pub fn describe(&self) -> String {
        let source = match &self.header {
            Some(header) => format!("the `{header}` header"),
            None => "the request itself".to_owned(),
        };
        let mismatch = self.status(RejectionKind::Mismatch);
        let in_flight = self.status(RejectionKind::InFlight);
        let reach = if self.across_endpoints {
            format!(
                "the authenticated account (a key used on another endpoint is refused with \
                 `{mismatch}`)"
            )
        } else {
            "the authenticated account and this endpoint".to_owned()
        };
        let rule = match &self.rule {
            Some((_, Some("uuid"))) => " Keys must be UUIDs.".to_owned(),
            Some((name, _)) => format!(" Keys must follow the rule `{name}`."),
            None => String::new(),
        };
        format!(
            "Idempotent: a retry with the same key, from {source}, gets the first response back \
             (marked `Idempotent-Replayed: true`) instead of running again, for {ttl} after the \
             first request. A key is scoped to {reach}; reused with a different request it is \
             refused with `{mismatch}`, and while its first request is still running, with \
             `{in_flight}` (`Retry-After`).{rule}",
            ttl = in_words(self.ttl),
        )
    }

    /// Documents one operation: the key's parameter, the replay headers, the refusals, the
    /// facts for tools and the policy in words.
    fn document(&self, operation: &mut Operation) {
        if let Some(header) = &self.header {
            self.document_key(header, operation);
        }
        document_replay_headers(&self.replayed, operation);
        self.document_refusals(operation);
        self.document_facts(operation);
        let description = operation.description.get_or_insert_with(String::new);
        if !description.is_empty() {
            description.push_str("\n\n");
        }
        description.push_str(&self.describe());
    }

    /// The key's header parameter, first among the operation's parameters.
    fn document_key(&self, header: &str, operation: &mut Operation) {
        let mut schema = ObjectBuilder::new()
            .schema_type(Type::String)
            .min_length(Some(1))
            .max_length(Some(crate::key::MAX_KEY_LEN));
        if let Some((_, Some("uuid"))) = &self.rule {
            schema = schema.format(Some(SchemaFormat::Custom("uuid".to_owned())));
        }
        let parameters = operation.parameters.get_or_insert_with(Vec::new);
        parameters.retain(|parameter| !parameter.name.eq_ignore_ascii_case(header));
        parameters.insert(
            0,
            ParameterBuilder::new()
                .name(header)
                .parameter_in(ParameterIn::Header)
                .required(if self.required {
                    Required::True
                } else {
                    Required::False
                })
                .description(Some(self.describe()))
                .schema(Some(schema))
                .build(),
        );
    }

    /// The layer's refusals, under the statuses the operation does not document itself.
    fn document_refusals(&self, operation: &mut Operation) {
        let schema = self
            .refusal_schema
            .clone()
            .unwrap_or_else(|| RefOr::Ref(utoipa::openapi::Ref::from_schema_name(PROBLEM_SCHEMA)));
        for (status, kinds) in self.refusals() {
            let status = status.to_string();
            if operation.responses.responses.contains_key(&status) {
                continue;
            }
            let description = kinds
                .iter()
                .map(|kind| format!("{} (`{}`)", kind.title(), kind.code()))
                .collect::<Vec<_>>()
                .join("; ");
            let response = ResponseBuilder::new()
                .description(description)
                .content(
                    PROBLEM_JSON,
                    ContentBuilder::new().schema(Some(schema.clone())).build(),
                )
                .build();
            operation
                .responses
                .responses
                .insert(status, RefOr::T(response));
        }
    }

    /// The `x-idempotency` extension: the same facts, for tools.
    fn document_facts(&self, operation: &mut Operation) {
        let facts = serde_json::json!({
            "header": self.header,
            "required": self.required,
            "ttl_seconds": self.ttl.as_secs(),
            "scope": if self.across_endpoints { "principal" } else { "principal and endpoint" },
            "key_rule": self.rule.as_ref().map(|(name, _)| name),
            "replayed_header": self.replayed,
            // By the stable codes clients switch on (`RejectionKind::code`).
            "refusals": self.refusals().iter().map(|(status, kinds)| {
                let codes: Vec<&str> = kinds.iter().map(|kind| kind.code()).collect();
                (status.to_string(), serde_json::json!(codes))
            }).collect::<serde_json::Map<_, _>>(),
        });
        operation
            .extensions
            .get_or_insert_with(Extensions::default)
            .insert("x-idempotency".to_owned(), facts);
    }

    /// The statuses the layer may answer instead of the handler, and why.
    fn refusals(&self) -> Vec<(u16, Vec<RejectionKind>)> {
        let mut kinds = vec![
            RejectionKind::KeyInvalid,
            RejectionKind::BodyUnreadable,
            RejectionKind::InFlight,
            RejectionKind::BodyTooLarge,
            RejectionKind::Mismatch,
            RejectionKind::StoreUnavailable,
            RejectionKind::Overloaded,
        ];
        if self.required {
            kinds.insert(0, RejectionKind::KeyMissing);
        }
        let mut refusals: Vec<(u16, Vec<RejectionKind>)> = Vec::new();
        for kind in kinds {
            let status = self.status(kind);
            match refusals.iter_mut().find(|(known, _)| *known == status) {
                Some((_, same)) => same.push(kind),
                None => refusals.push((status, vec![kind])),
            }
        }
        refusals
    }
}

/// `Idempotent-Replayed` on each of the operation's responses, and `Idempotent-Replay-Body`
/// for a replay whose body was too large to keep.
fn document_replay_headers(replayed_header: &str, operation: &mut Operation) {
    let header = |value: &str, description: &str| {
        HeaderBuilder::new()
            .schema(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .enum_values(Some([value])),
            )
            .description(Some(description))
            .build()
    };
    let replayed = header(
        "true",
        "`true` when this response is the replay of the key's first response",
    );
    let omitted = header(
        "omitted",
        "`omitted` when this replay's original body was too large to keep: the body is a \
         problem document saying so, the status is the original one",
    );
    for response in operation.responses.responses.values_mut() {
        if let RefOr::T(response) = response {
            let headers = &mut response.headers;
            headers.insert(replayed_header.to_owned(), replayed.clone());
            headers.insert(
                header_title(IDEMPOTENT_REPLAY_BODY.as_str()),
                omitted.clone(),
            );
        }
    }
}

/// An RFC 9457 problem document, as the layer renders its refusals by default.
fn problem_schema() -> Object {
    let string = |description: &str| {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .description(Some(description))
    };
    ObjectBuilder::new()
        .schema_type(Type::Object)
        .description(Some(
            "A refusal by the idempotency layer, as an RFC 9457 problem document",
        ))
        .property(
            "type",
            string("A URI identifying the kind of refusal")
                .format(Some(SchemaFormat::Custom("uri".to_owned()))),
        )
        .property(
            "code",
            string("The kind of refusal, a stable code to switch on")
                .enum_values(Some(RejectionKind::ALL.iter().map(|kind| kind.code()))),
        )
        .property("title", string("The kind of refusal, in words"))
        .property(
            "status",
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .description(Some("The HTTP status")),
        )
        .property("detail", string("What happened to this request"))
        .required("type")
        .required("code")
        .required("title")
        .required("status")
        .build()
}

/// A duration as a person says it: `24 hours`, `7 days`, `90 minutes`, `30 seconds`.
fn in_words(duration: Duration) -> String {
    if duration >= MAX_DURATION {
        return "ever".to_owned();
    }
    let seconds = duration.as_secs();
    let (count, unit) = [(86_400, "day"), (3600, "hour"), (60, "minute")]
        .into_iter()
        .find(|(size, _)| seconds >= *size && seconds.is_multiple_of(*size))
        .map_or((seconds, "second"), |(size, unit)| (seconds / size, unit));
    match (count, unit) {
        (0, _) => format!("{} milliseconds", duration.as_millis()),
        (1, unit) => format!("1 {unit}"),
        (count, unit) => format!("{count} {unit}s"),
    }
}

impl std::fmt::Debug for IdempotencyApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyApi")
            .field("header", &self.header)
            .field("required", &self.required)
            .field("ttl", &self.ttl)
            .field("methods", &self.methods)
            .field("across_endpoints", &self.across_endpoints)
            .field("rule", &self.rule)
            .finish_non_exhaustive()
    }
}

impl utoipa::Modify for IdempotencyApi {
    fn modify(&self, openapi: &mut OpenApi) {
        self.apply(openapi);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The problem schema names every refusal's code, and replays document the omitted body.
    #[test]
    fn the_document_shows_codes_and_the_omitted_body_header() {
        use utoipa::openapi::{
            HttpMethod, OpenApiBuilder, PathItem, PathsBuilder, path::OperationBuilder,
        };
        let create = OperationBuilder::new()
            .response("200", ResponseBuilder::new().description("ok"))
            .build();
        let mut doc = OpenApiBuilder::new()
            .paths(PathsBuilder::new().path("/", PathItem::new(HttpMethod::Post, create)))
            .build();
        crate::IdempotencyLayer::memory().openapi().apply(&mut doc);
        let doc = serde_json::to_value(&doc).expect("json");
        let problem = &doc["components"]["schemas"][PROBLEM_SCHEMA];
        let codes = problem["properties"]["code"]["enum"]
            .as_array()
            .expect("codes");
        let all: Vec<_> = RejectionKind::ALL.iter().map(|kind| kind.code()).collect();
        assert_eq!(codes, &all);
        assert!(
            problem["required"]
                .as_array()
                .expect("required")
                .contains(&"code".into())
        );
        let headers = &doc["paths"]["/"]["post"]["responses"]["200"]["headers"];
        assert_eq!(
            headers["Idempotent-Replay-Body"]["schema"]["enum"][0],
            "omitted"
        );
        let conflict = doc["paths"]["/"]["post"]["responses"]["409"]["description"].as_str();
        assert!(
            conflict.expect("409").contains("`in-flight`"),
            "{conflict:?}"
        );
    }

    #[test]
    fn durations_in_words() {
        assert_eq!(in_words(Duration::from_secs(24 * 3600)), "1 day");
        assert_eq!(in_words(Duration::from_secs(48 * 3600)), "2 days");
        assert_eq!(in_words(Duration::from_secs(3600)), "1 hour");
        assert_eq!(in_words(Duration::from_secs(5400)), "90 minutes");
        assert_eq!(in_words(Duration::from_secs(90)), "90 seconds");
        assert_eq!(in_words(Duration::from_millis(500)), "500 milliseconds");
        assert_eq!(in_words(MAX_DURATION), "ever");
    }
}
