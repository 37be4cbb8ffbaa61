//! The command line: every option a flag, else an environment variable, else a default (the
//! table is in the [server's documentation](super)).

use std::{net::SocketAddr, time::Duration};

use base64::{Engine, engine::general_purpose::STANDARD};
use clap::{ArgAction, Parser, builder::BoolishValueParser};
use tower_idempotency::store::SealingKeys;

use super::RunError;
use crate::{Settings, StepSecret, webhooks::WebhookSecret};

/// The command line; see the [server's documentation](super) for the table of options.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "charges-demo",
    version,
    about = "A Stripe-style payments API whose POST /v1/charges runs once per Idempotency-Key"
)]
pub struct Args {
    /// The address to listen on (port 0: any free port; the bound address is printed).
    #[arg(
        long,
        env = "LISTEN_ADDR",
        default_value = "127.0.0.1:3000",
        value_name = "ADDR"
    )]
    pub listen: SocketAddr,

    /// PostgreSQL for idempotency keys and charges; without it, both live in memory.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, value_name = "URL")]
    pub database_url: Option<String>,

    /// Simulated card-processor latency of every charge, in milliseconds.
    #[arg(
        long,
        env = "CHARGE_PROCESSING_DELAY_MS",
        default_value_t = 0,
        value_name = "N"
    )]
    pub processing_delay_ms: u64,

    /// How long an idempotency key and its stored response live, in seconds.
    #[arg(
        long,
        env = "IDEMPOTENCY_KEY_TTL_SECS",
        default_value_t = 86_400,
        value_name = "N",
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub key_ttl_secs: u64,

    /// How long a key is held without renewal before a retry may take it over, in seconds.
    #[arg(
        long,
        env = "IDEMPOTENCY_LEASE_SECS",
        default_value_t = 30,
        value_name = "N",
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub lease_secs: u64,

    /// How long a duplicate of a charge still being processed waits for its answer instead of
    /// getting `409` at once, in milliseconds (0: answer `409`, the IETF draft's behaviour).
    #[arg(
        long,
        env = "IDEMPOTENCY_IN_FLIGHT_WAIT_MS",
        default_value_t = 0,
        value_name = "N"
    )]
    pub in_flight_wait_ms: u64,

    /// Seals stored responses with this AES-256 key (32 bytes, base64); without it, they are
    /// stored in clear.
    #[arg(
        long,
        env = "CHARGES_DEMO_SEAL_KEY",
        hide_env_values = true,
        value_name = "BASE64"
    )]
    pub seal_key: Option<String>,

    /// The card network to authorize charges at (`http://host:port`, an `acquirer`); without
    /// it, an acquirer in this process.
    #[arg(long, env = "CHARGES_DEMO_ACQUIRER_URL", value_name = "URL")]
    pub acquirer_url: Option<String>,

    /// The secret the steps' downstream keys are derived from (at least 32 bytes), the same on
    /// every instance and across restarts; without it, a development secret.
    #[arg(
        long,
        env = "CHARGES_DEMO_STEP_SECRET",
        hide_env_values = true,
        value_name = "SECRET"
    )]
    pub step_secret: Option<String>,

    /// The secret the acquirer signs its webhooks with (`whsec_` and base64, as Standard
    /// Webhooks writes it); without it, a development secret, printed at start-up.
    #[arg(long, env = "CHARGES_DEMO_WEBHOOK_SECRET", hide_env_values = true,
          value_name = "WHSEC", value_parser = WebhookSecret::parse)]
    pub webhook_secret: Option<WebhookSecret>,

    /// Finishes charges left mid-way (the server crashed and the client never retried), as the
    /// client's retry would: needs `--database-url`.
    #[arg(long, env = "CHARGES_DEMO_COMPLETER", action = ArgAction::SetTrue,
          value_parser = BoolishValueParser::new())]
    pub completer: bool,

    /// How long after a charge's lease lapsed its client has to retry before the completer
    /// finishes it, in seconds.
    #[arg(
        long,
        env = "CHARGES_DEMO_COMPLETER_GRACE_SECS",
        default_value_t = 60,
        value_name = "N",
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub completer_grace_secs: u64,
}

/// The key id of `--seal-key`: the demo has one key; an app that rotates numbers its keys.
pub(super) const SEAL_KEY_ID: u32 = 1;

impl Args {
    /// The sealing keys of `--seal-key`, if given. The key itself is never echoed.
    ///
    /// # Errors
    ///
    /// [`RunError::SealKey`] unless it is 32 bytes in standard base64.
    pub fn seal_keys(&self) -> Result<Option<SealingKeys>, RunError> {
        let Some(encoded) = &self.seal_key else {
            return Ok(None);
        };
        let key = STANDARD
            .decode(encoded.trim())
            .ok()
            .and_then(|bytes| <[u8; 32]>::try_from(bytes).ok())
            .ok_or(RunError::SealKey)?;
        Ok(Some(SealingKeys::new(SEAL_KEY_ID, key)))
    }

    /// The [`Settings`] these options give.
    pub fn settings(&self) -> Settings {
        Settings {
            key_ttl: Duration::from_secs(self.key_ttl_secs),
            lease: Duration::from_secs(self.lease_secs),
            processing_delay: Duration::from_millis(self.processing_delay_ms),
            // The flag's 0 is "no waiting"; the layer itself takes no zero wait.
            in_flight_wait: (self.in_flight_wait_ms > 0)
                .then(|| Duration::from_millis(self.in_flight_wait_ms)),
            acquirer_url: self.acquirer_url.clone(),
            step_secret: self
                .step_secret
                .as_ref()
                .map_or_else(StepSecret::default, |secret| {
                    StepSecret(secret.as_bytes().to_vec())
                }),
            webhook_secret: self.webhook_secret.clone().unwrap_or_default(),
            completer_grace: self
                .completer
                .then(|| Duration::from_secs(self.completer_grace_secs)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("charges-demo").chain(args.iter().copied()))
    }

    #[test]
    fn flags_parse_into_settings() {
        let args = parse(&[
            "--listen",
            "127.0.0.1:0",
            "--processing-delay-ms",
            "1500",
            "--key-ttl-secs",
            "600",
            "--lease-secs",
            "10",
            "--in-flight-wait-ms",
            "2500",
        ])
        .unwrap();
        assert_eq!(args.listen, "127.0.0.1:0".parse().unwrap());
        assert_eq!(
            args.settings(),
            Settings {
                key_ttl: Duration::from_secs(600),
                lease: Duration::from_secs(10),
                processing_delay: Duration::from_millis(1500),
                in_flight_wait: Some(Duration::from_millis(2500)),
                ..Settings::default()
            }
        );
        assert!(parse(&["--lease-secs", "0"]).is_err());
        assert_eq!(args.seal_keys().unwrap().map(|k| k.sealing_key_id()), None);
        let sealed = parse(&["--seal-key", &"A".repeat(43)]).unwrap();
        assert!(
            sealed.seal_keys().is_err(),
            "43 characters are not 32 bytes"
        );
        let sealed = parse(&["--seal-key", &format!("{}=", "A".repeat(43))]).unwrap();
        assert_eq!(
            sealed.seal_keys().unwrap().map(|k| k.sealing_key_id()),
            Some(1)
        );
        assert!(parse(&["--listen", "not an address"]).is_err());
        assert_eq!(args.settings().completer_grace, None);
        let completing = parse(&["--completer", "--completer-grace-secs", "5"]).unwrap();
        assert_eq!(
            completing.settings().completer_grace,
            Some(Duration::from_secs(5))
        );
        assert!(parse(&["--completer", "--completer-grace-secs", "0"]).is_err());
    }
}
