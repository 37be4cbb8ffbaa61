//! `--fail-rate`: some calls answered `503`, before the authorization or after it (a lost
//! answer), so a caller's retry must carry the same key.

use std::sync::{Arc, Mutex, PoisonError};

use axum::{
    Json,
    extract::{Request, State},
    middleware::Next,
    response::{IntoResponse, Response},
};
use http::StatusCode;
use rand::{RngExt, SeedableRng, rngs::SmallRng};
use serde_json::json;

/// The failures' rate and random choices. Clones share the generator.
#[derive(Debug, Clone)]
pub(crate) struct Faults {
    rate: f64,
    rng: Arc<Mutex<SmallRng>>,
}

/// Where a failing call fails.
enum Fault {
    Before,
    After,
}

impl Faults {
    pub(crate) fn new(rate: f64, seed: Option<u64>) -> Self {
        let seed = seed.unwrap_or_else(|| u64::from(uuid::Uuid::new_v4().as_fields().0));
        Self {
            rate: rate.clamp(0.0, 1.0),
            rng: Arc::new(Mutex::new(SmallRng::seed_from_u64(seed))),
        }
    }

    fn draw(&self) -> Option<Fault> {
        if self.rate <= 0.0 {
            return None;
        }
        let mut rng = self.rng.lock().unwrap_or_else(PoisonError::into_inner);
        let x: f64 = rng.random();
        // The lower half of the failing range fails before, the upper half after.
        (x < self.rate).then(|| {
            if x < self.rate / 2.0 {
                Fault::Before
            } else {
                Fault::After
            }
        })
    }
}

/// Fails the call as [`Faults`] draws, else passes it on.
pub(crate) async fn inject(State(faults): State<Faults>, request: Request, next: Next) -> Response {
    match faults.draw() {
        None => next.run(request).await,
        Some(Fault::Before) => unavailable("the network is unavailable; nothing was done"),
        Some(Fault::After) => {
            drop(next.run(request).await);
            unavailable("the answer was lost; retry with the same key")
        }
    }
}

fn unavailable(message: &str) -> Response {
    let body = json!({"error": {"type": "api_error", "message": message}});
    (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
}
