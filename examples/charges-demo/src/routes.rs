//! The handlers of the API: create, retrieve and list charges and refunds.

use axum::{
    Extension,
    body::Bytes,
    extract::{OriginalUri, Path, RawQuery, State},
    response::{IntoResponse, Response},
};
use http::{HeaderMap, Method, StatusCode, header};
use serde::Serialize;
use tower_idempotency::{Completing, IdempotencyContext, IdempotentTx};

use crate::{
    auth::Account,
    error::{ApiError, json, json_response},
    ledger::{Charge, Ledger, Page},
    params::{ChargeParams, RefundParams},
    processor::{Authorization, CardProcessor},
    steps,
    unavailable::server_failure,
};

/// The default page size of `GET /v1/charges` and `GET /v1/refunds`.
pub const DEFAULT_LIST_LIMIT: usize = 10;
/// The largest page size of `GET /v1/charges` and `GET /v1/refunds`.
pub const MAX_LIST_LIMIT: usize = 100;

/// What the handlers share.
#[derive(Clone)]
pub(crate) struct Api<L> {
    pub(crate) ledger: L,
    pub(crate) processor: CardProcessor,
}

/// `POST /v1/charges`, run under the idempotency layer in lease mode: validate, authorize the
/// card at the acquirer (step `authorize`), take the processing delay, record the charge (step
/// `ledger`), answer. Each of its answers is final for the key except the `400`s and `5xx`s:
/// the `400`s release it, and a `5xx` once the card may be authorized gives it up part-way
/// (`Retention::Abandon`); a retry, or the completer, goes on at the first unfinished
/// [step](crate::steps).
///
/// Behind a transactional store (which gives no steps: the chaos run's proof of that mode), the
/// charge row is written through the request's transaction instead, and commits with the stored
/// response.
pub(crate) async fn create_charge<L: Ledger>(
    State(api): State<Api<L>>,
    Extension(account): Extension<Account>,
    idempotency: IdempotencyContext,
    transaction: Option<IdempotentTx>,
    completing: Option<Extension<Completing>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let params = ChargeParams::parse(content_type(&headers), &body)?;
    if let Some(Extension(completing)) = completing {
        // Its client went away: the servers finish the charge as its retry would.
        tracing::info!(
            key = %idempotency.scope_key(),
            attempt = completing.attempt(),
            "completing a charge its client left mid-way"
        );
    }
    if let Some(transaction) = transaction {
        return charge_in_transaction(&api, &account, &idempotency, transaction, params).await;
    }
    let steps = steps::of(&idempotency)?;
    if idempotency.takeover() {
        // The previous holder of this key stopped (crashed or hung) mid-way: its finished steps
        // are recorded, and this attempt goes on after them.
        tracing::warn!(
            key = %idempotency.scope_key(),
            account = account.as_str(),
            "retrying a charge whose first attempt stopped mid-way"
        );
    }

    let authorized = steps::authorize(steps, &api.processor, &params).await?;
    // Between the authorization and the ledger write: the worst place for a crash.
    api.processor.processing().await;
    let authorization = authorized.authorization();
    let mut charge = Charge::new(&account, params, authorization);
    // The id the acquirer was told with the authorization (see `charge_id_for`).
    let told = steps.downstream_key("authorize").to_string();
    charge.id = crate::ledger::charge_id_for(&told).unwrap_or(charge.id);
    let body = steps::record_charge(steps, &api.ledger, &charge).await?;
    tracing::info!(
        charge = %charge.id,
        account = account.as_str(),
        amount = charge.amount,
        currency = %charge.currency,
        status = charge.status.as_str(),
        authorization = %authorized.id,
        key = %idempotency.scope_key(),
        "charge created"
    );

    match authorization {
        Authorization::Approved => Ok(json_response(StatusCode::OK, body)),
        declined => answer(&charge, declined),
    }
}

/// The charge's answer: the charge, or its decline as a `402` card error.
fn answer(charge: &Charge, authorization: Authorization) -> Result<Response, ApiError> {
    match authorization {
        Authorization::Approved => Ok(json(StatusCode::OK, charge)),
        Authorization::Declined(decline) => Err(ApiError::card_declined(
            charge.id.clone(),
            decline.code,
            decline.message,
        )),
    }
}

/// A charge in transactional mode: authorized under the request's scope key, written through
/// the request's transaction, which commits with the stored response (see `create_charge`).
async fn charge_in_transaction<L: Ledger>(
    api: &Api<L>,
    account: &Account,
    idempotency: &IdempotencyContext,
    mut transaction: IdempotentTx,
    params: ChargeParams,
) -> Result<Response, ApiError> {
    let key = idempotency.scope_key().to_string();
    let authorized = api
        .processor
        .authorize(&params, &key)
        .await
        .map_err(|error| steps::network_failed(&error))?;
    api.processor.processing().await;
    let authorization = authorized.authorization();
    let charge = Charge::new(account, params, authorization);
    let recorded = api.ledger.insert(&charge, Some(&mut transaction)).await;
    // Given back before the handler returns: the layer then stores the response and commits.
    drop(transaction);
    recorded.map_err(|error| {
        tracing::warn!("recording a charge failed");
        server_failure(&error)
    })?;
    answer(&charge, authorization)
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

/// `POST /v1/refunds`, under the same idempotency layer as `POST /v1/charges` (one key per
/// account across both): validate, send the refund to the card network, record it (step
/// `refund`). Its refusals are `400`s (and a `404` for a charge it cannot find), so a corrected
/// retry runs.
///
/// In PostgreSQL mode the refund row and the charge's `amount_refunded` are written in the
/// step's transaction, the charge locked until it commits with the step's record: a refund
/// happens once however often it is sent, and concurrent refunds of one charge take turns.
///
/// Behind a transactional store, the rows are written through the request's transaction.
pub(crate) async fn create_refund<L: Ledger>(
    State(api): State<Api<L>>,
    Extension(account): Extension<Account>,
    idempotency: IdempotencyContext,
    mut transaction: Option<IdempotentTx>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let params = RefundParams::parse(content_type(&headers), &body)?;
    api.processor.refund().await;
    let refunded = match transaction.as_deref_mut() {
        Some(connection) => {
            let refunded = api.ledger.refund(&account, &params, Some(connection)).await;
            refunded.map_err(|error| {
                tracing::warn!("recording a refund failed");
                server_failure(&error)
            })?
        }
        None => {
            let steps = steps::of(&idempotency)?;
            steps::record_refund(steps, &api.ledger, &account, &params).await?
        }
    };
    // Given back before the handler returns: the layer then stores the response and commits.
    drop(transaction);
    let refund = refunded.map_err(|refusal| {
        tracing::info!(
            charge = %params.charge,
            account = account.as_str(),
            amount = params.amount,
            %refusal,
            "refund refused"
        );
        refusal.error(&params.charge)
    })?;
    tracing::info!(
        refund = %refund.id,
        charge = %refund.charge,
        account = account.as_str(),
        amount = refund.amount,
        key = %idempotency.scope_key(),
        "refund created"
    );
    Ok(json(StatusCode::OK, &refund))
}

/// `GET /v1/refunds/{id}`: one of the caller's refunds.
pub(crate) async fn retrieve_refund<L: Ledger>(
    State(api): State<Api<L>>,
    Extension(account): Extension<Account>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    match api.ledger.retrieve_refund(&account, &id).await {
        Ok(Some(refund)) => Ok(json(StatusCode::OK, &refund)),
        Ok(None) => Err(ApiError::no_such("refund", &id, "id")),
        Err(error) => Err(ledger_failed(&error)),
    }
}

/// Stripe's list object.
#[derive(Serialize)]
struct List<'a, T> {
    object: &'static str,
    data: &'a [T],
    has_more: bool,
    url: &'static str,
}

impl<T: Serialize> List<'_, T> {
    fn respond(page: &Page<T>, url: &'static str) -> Response {
        json(
            StatusCode::OK,
            &List {
                object: "list",
                data: &page.data,
                has_more: page.has_more,
                url,
            },
        )
    }
}

/// A list's `?limit=N&starting_after=ID`.
struct ListQuery {
    limit: usize,
    starting_after: Option<String>,
}

impl ListQuery {
    fn parse(query: Option<&str>) -> Result<Self, ApiError> {
        let mut limit = DEFAULT_LIST_LIMIT;
        let mut starting_after = None;
        for (name, value) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
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
        Ok(Self {
            limit,
            starting_after,
        })
    }
}

/// A `starting_after` that names no `object` of the caller's.
fn unknown_cursor(object: &str, cursor: &str) -> ApiError {
    ApiError::no_such(object, cursor, "starting_after").with_status(StatusCode::BAD_REQUEST)
}

/// `GET /v1/charges?limit=N&starting_after=ch_...`: the caller's charges, newest first.
pub(crate) async fn list_charges<L: Ledger>(
    State(api): State<Api<L>>,
    Extension(account): Extension<Account>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    list_page(
        query.as_deref(),
        ("charge", "/v1/charges"),
        async |id| api.ledger.retrieve(&account, id).await,
        async |limit, after| api.ledger.list(&account, limit, after).await,
    )
    .await
}

/// `GET /v1/refunds?limit=N&starting_after=re_...`: the caller's refunds, newest first.
pub(crate) async fn list_refunds<L: Ledger>(
    State(api): State<Api<L>>,
    Extension(account): Extension<Account>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    list_page(
        query.as_deref(),
        ("refund", "/v1/refunds"),
        async |id| api.ledger.retrieve_refund(&account, id).await,
        async |limit, after| api.ledger.list_refunds(&account, limit, after).await,
    )
    .await
}

/// One page of a list at `url`: a `starting_after` that `retrieve` does not find is a `400`
/// naming the `object` (the ledger alone would answer an empty page).
async fn list_page<T: Serialize, O, E: std::error::Error + 'static>(
    query: Option<&str>,
    (object, url): (&str, &'static str),
    retrieve: impl AsyncFnOnce(&str) -> Result<Option<O>, E>,
    page: impl AsyncFnOnce(usize, Option<&str>) -> Result<Page<T>, E>,
) -> Result<Response, ApiError> {
    let ListQuery {
        limit,
        starting_after,
    } = ListQuery::parse(query)?;
    if let Some(cursor) = &starting_after {
        let exists = retrieve(cursor)
            .await
            .map_err(|error| ledger_failed(&error))?;
        if exists.is_none() {
            return Err(unknown_cursor(object, cursor));
        }
    }
    let page = page(limit, starting_after.as_deref())
        .await
        .map_err(|error| ledger_failed(&error))?;
    Ok(List::respond(&page, url))
}

/// Any other URL.
pub(crate) async fn not_found(method: Method, OriginalUri(uri): OriginalUri) -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        crate::error::ErrorType::InvalidRequestError,
        format!(
            "Unrecognized request URL ({method}: {}). This demo serves POST and GET /v1/charges, \
             GET /v1/charges/{{id}}, POST and GET /v1/refunds, GET /v1/refunds/{{id}}, GET \
             /v1/balance and POST /v1/webhooks/acquirer.",
            uri.path()
        ),
    )
    .into_response()
}

/// The request's `Content-Type`, if any.
fn content_type(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::CONTENT_TYPE)
        .map(|value| value.to_str().unwrap_or("(not ASCII)"))
}

fn ledger_failed(error: &(dyn std::error::Error + 'static)) -> ApiError {
    tracing::warn!("reading the ledger failed");
    server_failure(error)
}
