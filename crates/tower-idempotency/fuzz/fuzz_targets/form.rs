//! Arbitrary bytes as an `application/x-www-form-urlencoded` body.
//!
//! * `canonical_form_pairs` never panics, yields one pair per non-empty `&`-separated segment,
//!   sorted by name, and decodes no pair to more bytes than it had;
//! * reordering the segments so that pairs with the same decoded name keep their relative order
//!   (any permutation, when all names differ) gives the same `Fingerprint`.
//!
//! The first byte of the input seeds the permutation; the rest is the body.
#![no_main]

use std::collections::{HashMap, VecDeque};

use http::{HeaderValue, Method, Uri};
use libfuzzer_sys::fuzz_target;
use tower_idempotency::{
    Fingerprint, FingerprintMode,
    FormPair, canonical_form_pairs,
};

fuzz_target!(|data: &[u8]| {
    let Some((&seed, body)) = data.split_first() else {
        return;
    };
    let pairs = canonical_form_pairs(body);
    let segments: Vec<&[u8]> = body
        .split(|b| *b == b'&')
        .filter(|s| !s.is_empty())
        .collect();
    assert_eq!(pairs.len(), segments.len());
    assert!(pairs.windows(2).all(|w| w[0].0 <= w[1].0), "not sorted");
    let decoded: usize = pairs.iter().map(|(n, v)| n.len() + v.len()).sum();
    let encoded: usize = segments.iter().map(|s| s.len()).sum();
    assert!(
        decoded <= encoded,
        "decoding grew {encoded} bytes to {decoded}"
    );

    // Shuffle the segments, then restore the relative order of same-name pairs.
    let mut order: Vec<usize> = (0..segments.len()).collect();
    shuffle(&mut order, seed);
    let names: Vec<Vec<u8>> = segments
        .iter()
        .map(|s| canonical_form_pairs(s).remove(0).0.into_owned())
        .collect();
    // Each name's slots in the shuffled order are refilled with its segments in their order.
    let mut queues = HashMap::<&[u8], VecDeque<usize>>::new();
    for (i, name) in names.iter().enumerate() {
        queues.entry(name).or_default().push_back(i);
    }
    let permuted: Vec<&[u8]> = order
        .iter()
        .map(|&i| {
            let next = queues
                .get_mut(names[i].as_slice())
                .and_then(VecDeque::pop_front)
                .expect("one segment per slot");
            segments[next]
        })
        .collect();
    let permuted = permuted.join(&b'&');

    let permuted_pairs: Vec<FormPair<'_>> = canonical_form_pairs(&permuted);
    assert_eq!(pairs, permuted_pairs);
    assert_eq!(fingerprint(body), fingerprint(&permuted));
});

fn fingerprint(body: &[u8]) -> Fingerprint {
    Fingerprint::compute(
        FingerprintMode::Semantic,
        &Method::POST,
        &Uri::from_static("/v1/charges"),
        Some(&HeaderValue::from_static(
            "application/x-www-form-urlencoded",
        )),
        body,
    )
}

/// A Fisher–Yates shuffle driven by a tiny LCG seeded from one byte.
fn shuffle(items: &mut [usize], seed: u8) {
    let mut state = u32::from(seed).wrapping_mul(2_654_435_761).wrapping_add(1);
    for i in (1..items.len()).rev() {
        state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        let j = (state >> 16) as usize % (i + 1);
        items.swap(i, j);
    }
}
