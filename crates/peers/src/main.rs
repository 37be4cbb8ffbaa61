//! `peers`: tower-idempotency and another idempotency middleware for Axum given the same
//! requests over real HTTP on loopback, side by side.
//!
//! ```text
//! cargo run --release -p peers -- [--handler-ms N] [--duration-secs N] [--rounds N] [--connections N]
//! ```
//!
//! The peer is [axum-idempotent](https://crates.io/crates/axum-idempotent) 0.6, the
//! idempotency middleware for Axum on crates.io that comes closest in scope, configured as its
//! README shows for payments: direct-key mode on the `Idempotency-Key` header (required), over
//! ruts' in-memory session store — the same class of store as tower-idempotency's
//! `MemoryStore`, so neither side pays for a database. Both wrap the same charge handler, which
//! counts its runs per key.
//!
//! **Part 1, behaviour.** Each [case](probe::CASES) is played against each server with a key of
//! its own; the table shows how many times the handler ran and what the client got back. The
//! handler takes `--handler-ms` (a card network's latency), so duplicates overlap.
//!
//! **Part 2, throughput.** The bare handler (no delay), then each layer on it: 32 keep-alive
//! clients, each with a session of its own (the peer caches only in a session), a new key per
//! request, back to back. Rounds alternate the order; each server is started fresh per round;
//! figures are medians over rounds, ratios are to the bare handler of the same round.
//!
//! Servers and clients share this process and the machine's cores alike: the ratios are the
//! point, not the absolute numbers. It is not a test, and CI only builds it.

mod load;
mod probe;
mod servers;

use std::{fmt::Write as _, time::Duration};

use clap::Parser;

use crate::servers::{Kind, Server};

/// Sends the same requests to tower-idempotency and to axum-idempotent and prints what each did.
#[derive(Debug, Parser)]
#[command(name = "peers", version)]
struct Cli {
    /// How long the charge handler takes in part 1 (milliseconds).
    #[arg(long, default_value_t = 200)]
    handler_ms: u64,
    /// Seconds each server is measured in part 2, per round.
    #[arg(long, default_value_t = 5)]
    duration_secs: u64,
    /// Rounds of part 2 (medians are reported).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Concurrent clients in part 2.
    #[arg(long, default_value_t = 32)]
    connections: usize,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let cli = Cli::parse();
    let mut out = String::from("## tower-idempotency and its peer, side by side\n\n");
    behaviour(&cli, &mut out).await?;
    throughput(&cli, &mut out).await?;
    print!("{out}");
    Ok(())
}

async fn behaviour(cli: &Cli, out: &mut String) -> Result<(), BoxError> {
    let delay = Duration::from_millis(cli.handler_ms.max(20));
    let ours = Server::start(Kind::Ours, delay).await?;
    let peer = Server::start(Kind::Peer, delay).await?;
    let http = reqwest::Client::new();
    let _ = writeln!(
        out,
        "### What the handler ran ({} ms handler, a fresh key per case)\n",
        delay.as_millis()
    );
    let _ = writeln!(
        out,
        "| case | what a payments API needs | {} | {} |\n|---|---|---|---|",
        ours.kind.name(),
        peer.kind.name()
    );
    for (i, case) in probe::CASES.into_iter().enumerate() {
        let mut cells = Vec::new();
        for server in [&ours, &peer] {
            let key = format!("probe-{i}");
            let outcome = probe::run(case, server, &http, &key, delay).await?;
            eprintln!("{:?} on {}: {outcome:?}", case, server.kind.name());
            cells.push(format!(
                "**{} run{}**: {}",
                outcome.runs,
                if outcome.runs == 1 { "" } else { "s" },
                summarize(&outcome.answers)
            ));
        }
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} |",
            case.describe(),
            case.expected(),
            cells[0],
            cells[1]
        );
    }
    Ok(())
}

/// `201, 201 (replay)` — runs of the same answer counted: `201, 409 ×8, 201 (replay) ×2`.
fn summarize(answers: &[String]) -> String {
    let mut parts: Vec<(String, usize)> = Vec::new();
    for answer in answers {
        match parts.last_mut() {
            Some((last, n)) if last == answer => *n += 1,
            _ => parts.push((answer.clone(), 1)),
        }
    }
    parts
        .into_iter()
        .map(|(answer, n)| {
            if n == 1 {
                answer
            } else {
                format!("{answer} ×{n}")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

async fn throughput(cli: &Cli, out: &mut String) -> Result<(), BoxError> {
    let kinds = [Kind::Bare, Kind::Ours, Kind::Peer];
    let rounds = cli.rounds.max(1);
    let mut samples: Vec<Vec<load::Measured>> = kinds.iter().map(|_| Vec::new()).collect();
    for round in 0..rounds {
        let mut order: Vec<usize> = (0..kinds.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            let server = Server::start(kinds[i], Duration::ZERO).await?;
            let measured = load::measure(
                &server,
                cli.connections,
                Duration::from_secs(1),
                Duration::from_secs(cli.duration_secs.max(1)),
            )
            .await?;
            eprintln!(
                "round {}/{rounds}  {:<40} {:>8.0} req/s  p50 {} µs  p99 {} µs  errors {}",
                round + 1,
                kinds[i].name(),
                measured.per_sec,
                measured.p50_us,
                measured.p99_us,
                measured.errors
            );
            samples[i].push(measured);
        }
    }
    let _ = writeln!(
        out,
        "\n### Throughput, new keys, no-I/O handler ({} clients, {} s × {rounds} rounds, medians)\n",
        cli.connections, cli.duration_secs
    );
    let _ = writeln!(
        out,
        "| server | req/s | p50 | p99 | errors |\n|---|--:|--:|--:|--:|"
    );
    for (i, kind) in kinds.iter().enumerate() {
        let ratio = |f: fn(&load::Measured) -> f64| {
            median(
                samples[i]
                    .iter()
                    .zip(&samples[0])
                    .map(|(s, bare)| f(s) / f(bare).max(1e-9)),
            )
        };
        let rate = median(samples[i].iter().map(|s| s.per_sec));
        let p50 = median(samples[i].iter().map(|s| s.p50_us as f64));
        let p99 = median(samples[i].iter().map(|s| s.p99_us as f64));
        let errors: u64 = samples[i].iter().map(|s| s.errors).sum();
        if i == 0 {
            let _ = writeln!(
                out,
                "| {} | {rate:.0} | {p50:.0} µs | {p99:.0} µs | {errors} |",
                kind.name()
            );
        } else {
            let _ = writeln!(
                out,
                "| {} | {rate:.0} ({:.2}×) | {p50:.0} µs ({:.2}×) | {p99:.0} µs ({:.2}×) | {errors} |",
                kind.name(),
                ratio(|s| s.per_sec),
                ratio(|s| s.p50_us as f64),
                ratio(|s| s.p99_us as f64),
            );
        }
    }
    Ok(())
}

fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut values: Vec<f64> = values.collect();
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}
