//! The handlers of the API: create, retrieve and list charges.

use axum::{
    Extension,
    body::Bytes,
    extract::{OriginalUri, Path, RawQuery, State},
    response::{IntoResponse, Response},
};
use http::{HeaderMap, Method, StatusCode, header};
use serde::Serialize;
use tower_idempotency::{IdempotencyContext, IdempotentTx};

use crate::{
    auth::Account,
    error::{ApiError, json},
    ledger::{Charge, Ledger},
    params::ChargeParams,
    processor::{Authorization, CardProcessor},
};

/// The default page size of `GET /v1/charges`.
pub const DEFAULT_LIST_LIMIT: usize = 10;
/// The largest page size of `GET /v1/charges`.
pub const MAX_LIST_LIMIT: usize = 100;

/// What the handlers share.
#[derive(Clone)]
pub(crate) struct Api<L> {
    pub(crate) ledger: L,
    pub(crate) processor: CardProcessor,
}

/// `POST /v1/charges`, run under the idempotency layer: validate, authorise the card, record
/// the charge, answer. Each of its answers is final for the key except the `400`s (and `500`s),
/// which the layer's default retention policy releases so that a corrected retry runs.
///
/// In PostgreSQL mode the layer is transactional and `transaction` is the request's open
/// transaction: the charge row is written through it and commits with the stored response. In
/// the embedded mode there is none.
pub(crate) async fn create_charge<L: Ledger>(
    State(api): State<Api<L>>,
    Extension(account): Extension<Account>,
    idempotency: IdempotencyContext,
    mut transaction: Option<IdempotentTx>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .map(|value| value.to_str().unwrap_or("(not ASCII)"));
    let params = ChargeParams::parse(content_type, &body)?;
    if idempotency.takeover() {
        // The previous holder of this key stopped (crashed or hung) mid-way. In transactional
        // mode whatever it wrote was rolled back with its transaction, so there is no
        // half-recorded charge to reconcile: this attempt starts from scratch.
        tracing::warn!(
            key = %idempotency.scope_key(),
            account = account.as_str(),
            "retrying a charge whose first attempt stopped mid-way"
        );
    }

    let authorization = api.processor.authorize(&params.source).await;
    let charge = Charge::new(&account, params, authorization);
    let recorded = api.ledger.insert(&charge, transaction.as_deref_mut()).await;
    // Given back before the handler returns: the layer then stores the response and commits.
    drop(transaction);
    recorded.map_err(|error| {
        tracing::error!(
            error = &error as &dyn std::error::Error,
            "recording a charge failed"
        );
        ApiError::internal()
    })?;
    tracing::info!(
        charge = %charge.id,
        account = account.as_str(),
        amount = charge.amount,
        currency = %charge.currency,
        status = charge.status.as_str(),
        key = %idempotency.scope_key(),
        "charge created"
    );

    match authorization {
        Authorization::Approved => Ok(json(StatusCode::OK, &charge)),
        Authorization::Declined(decline) => Err(ApiError::card_declined(
            charge.id,
            decline.code,
            decline.message,
        )),
    }
}

/// `GET /v1/charges/{id}`: one of the caller's charges.
pub(crate) async fn retrieve_charge<L: Ledger>(
    State(api): State<Api<L>>,
    Extension(account): Extension<Account>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    match api.ledger.retrieve(&account, &id).await {
        Ok(Some(charge)) => Ok(json(StatusCode::OK, &charge)),
        Ok(None) => Err(ApiError::no_such("charge", &id, "id")),
        Err(error) => Err(ledger_failed(&error)),
    }
}

/// Stripe's list object.
#[derive(Serialize)]
struct List<'a> {
    object: &'static str,
    data: &'a [Charge],
    has_more: bool,
    url: &'static str,
}

/// `GET /v1/charges?limit=N&starting_after=ch_...`: the caller's charges, newest first.
pub(crate) async fn list_charges<L: Ledger>(
    State(api): State<Api<L>>,
    Extension(account): Extension<Account>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let mut limit = DEFAULT_LIST_LIMIT;
    let mut starting_after = None;
    for (name, value) in form_urlencoded::parse(query.as_deref().unwrap_or("").as_bytes()) {
        match &*name {
            "limit" => {
                limit = value
                    .parse()
                    .ok()
                    .filter(|n| (1..=MAX_LIST_LIMIT).contains(n))
                    .ok_or_else(|| {
                        ApiError::invalid_param(
                            "limit",
                            "parameter_invalid_integer",
                            format!(
                                "Invalid limit: {value}. It must be an integer from 1 to \
                                 {MAX_LIST_LIMIT}."
                            ),
                        )
                    })?;
            }
            "starting_after" => starting_after = Some(value.into_owned()),
            other => return Err(ApiError::unknown_param(other)),
        }
    }
    if let Some(cursor) = &starting_after {
        let exists = api
            .ledger
            .retrieve(&account, cursor)
            .await
            .map_err(|error| ledger_failed(&error))?;
        if exists.is_none() {
            return Err(ApiError::no_such("charge", cursor, "starting_after")
                .with_status(StatusCode::BAD_REQUEST));
        }
    }
    let page = api
        .ledger
        .list(&account, limit, starting_after.as_deref())
        .await
        .map_err(|error| ledger_failed(&error))?;
    Ok(json(
        StatusCode::OK,
        &List {
            object: "list",
            data: &page.data,
            has_more: page.has_more,
            url: "/v1/charges",
        },
    ))
}

/// Any other URL.
pub(crate) async fn not_found(method: Method, OriginalUri(uri): OriginalUri) -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        crate::error::ErrorType::InvalidRequestError,
        format!(
            "Unrecognized request URL ({method}: {}). This demo serves POST /v1/charges, \
             GET /v1/charges and GET /v1/charges/{{id}}.",
            uri.path()
        ),
    )
    .into_response()
}

fn ledger_failed(error: &(dyn std::error::Error + 'static)) -> ApiError {
    tracing::error!(error, "reading the ledger failed");
    ApiError::internal()
}
