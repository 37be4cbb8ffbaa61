//! Form bodies and query strings as their decoded pairs, sorted by name, up to a bound.

use std::borrow::Cow;

use sha2::{Digest, Sha256};

use super::put_field;

/// At most this many pairs of a form body or query string are decoded and sorted.
pub(super) const MAX_FORM_PAIRS: usize = 10_000;

/// Hashed where the pair count goes when there were more than [`MAX_FORM_PAIRS`] and the raw
/// bytes follow: no count of decoded pairs is this large, so the two can never collide.
pub(super) const TOO_MANY_PAIRS: u64 = u64::MAX;

pub(super) fn put_pairs(hasher: &mut Sha256, encoded: &[u8]) {
    if more_pairs_than(encoded, MAX_FORM_PAIRS) {
        hasher.update(TOO_MANY_PAIRS.to_be_bytes());
        put_field(hasher, encoded);
        return;
    }
    let pairs = canonical_form_pairs(encoded);
    hasher.update((pairs.len() as u64).to_be_bytes());
    for (name, value) in &pairs {
        put_field(hasher, name);
        put_field(hasher, value);
    }
}

/// Whether `encoded` holds more than `limit` pairs (non-empty `&`-separated segments), counted
/// without decoding or allocating.
pub(super) fn more_pairs_than(encoded: &[u8], limit: usize) -> bool {
    encoded
        .split(|b| *b == b'&')
        .filter(|pair| !pair.is_empty())
        .nth(limit)
        .is_some()
}

/// A decoded form or query pair: name and value bytes.
pub type FormPair<'a> = (Cow<'a, [u8]>, Cow<'a, [u8]>);

/// The decoded name/value pairs of a `application/x-www-form-urlencoded` string, stably sorted
/// by name. Decoding is to bytes, not lossy UTF-8, so `%FE` and `%FF` stay different.
///
/// Every pair is decoded, however many there are; the fingerprint calls it only for strings of
/// at most 10,000 pairs (see [bounded work](crate::Fingerprint#bounded-work)).
pub fn canonical_form_pairs(encoded: &[u8]) -> Vec<FormPair<'_>> {
    let mut pairs: Vec<_> = encoded
        .split(|b| *b == b'&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (name, value) = match pair.iter().position(|b| *b == b'=') {
                Some(i) => (&pair[..i], &pair[i + 1..]),
                None => (pair, &[][..]),
            };
            (form_decode(name), form_decode(value))
        })
        .collect();
    pairs.sort_by(|(a, _), (b, _)| a.cmp(b));
    pairs
}

/// The form field names a fingerprint leaves out: those of top-level pointers (`/name`).
pub(super) fn excluded_names(pointers: &[String]) -> Vec<Vec<u8>> {
    pointers
        .iter()
        .filter_map(|pointer| pointer.strip_prefix('/'))
        .filter(|name| !name.contains('/'))
        .map(|name| name.replace("~1", "/").replace("~0", "~").into_bytes())
        .collect()
}

/// [`put_pairs`] of `encoded` without the pairs whose decoded name is in `names`, the others
/// joined by `&` as they came. Two passes over the bytes and no decoded copy: the first
/// measures what is kept, the second hashes it (or, for at most 10,000 pairs, copies it).
pub(super) fn put_pairs_without(hasher: &mut Sha256, encoded: &[u8], names: &[Vec<u8>]) {
    let kept = |segment: &&[u8]| {
        let name = segment.split(|b| *b == b'=').next().unwrap_or_default();
        !names.iter().any(|excluded| decodes_to(name, excluded))
    };
    let (mut all, mut segments, mut length, mut pairs) = (0usize, 0usize, 0usize, 0usize);
    for segment in encoded.split(|b| *b == b'&') {
        all += 1;
        if kept(&segment) {
            segments += 1;
            length += segment.len();
            pairs += usize::from(!segment.is_empty());
        }
    }
    if segments == all {
        return put_pairs(hasher, encoded);
    }
    let joined = encoded.split(|b| *b == b'&').filter(kept);
    if pairs <= MAX_FORM_PAIRS {
        let trimmed: Vec<u8> = joined.collect::<Vec<_>>().join(&b'&');
        return put_pairs(hasher, &trimmed);
    }
    hasher.update(TOO_MANY_PAIRS.to_be_bytes());
    hasher.update(((length + segments.saturating_sub(1)) as u64).to_be_bytes());
    let mut buffer = Vec::with_capacity(16 * 1024);
    for (i, segment) in joined.enumerate() {
        if i > 0 {
            buffer.push(b'&');
        }
        buffer.extend_from_slice(segment);
        if buffer.len() >= 16 * 1024 {
            hasher.update(&buffer);
            buffer.clear();
        }
    }
    hasher.update(&buffer);
}

/// Whether `encoded` form-decodes (`+` as space, then `%XX`) to `target`, without decoding
/// it into a copy. A decoded byte comes from one to three encoded ones.
fn decodes_to(encoded: &[u8], target: &[u8]) -> bool {
    if encoded.len() < target.len() || encoded.len() > 3 * target.len() {
        return false;
    }
    let mut at = 0;
    let mut decoded = std::iter::from_fn(|| {
        let b = *encoded.get(at)?;
        at += 1;
        let hex = |i: usize| encoded.get(i).and_then(|d| (*d as char).to_digit(16));
        Some(match b {
            b'+' => b' ',
            b'%' => match (hex(at), hex(at + 1)) {
                (Some(high), Some(low)) => {
                    at += 2;
                    (high * 16 + low) as u8
                }
                _ => b'%',
            },
            b => b,
        })
    });
    decoded
        .by_ref()
        .take(target.len() + 1)
        .eq(target.iter().copied())
}

pub(super) fn form_decode(input: &[u8]) -> Cow<'_, [u8]> {
    let plus_free: Cow<'_, [u8]> = if input.contains(&b'+') {
        Cow::Owned(
            input
                .iter()
                .map(|&b| if b == b'+' { b' ' } else { b })
                .collect(),
        )
    } else {
        Cow::Borrowed(input)
    };
    match plus_free {
        Cow::Borrowed(bytes) => percent_encoding::percent_decode(bytes).into(),
        Cow::Owned(bytes) => Cow::Owned(percent_encoding::percent_decode(&bytes).collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::{Fingerprint, FingerprintMode, testing::*};

    #[test]
    fn form_pairs_are_sorted_by_name_keeping_repeated_values_in_order() {
        let a = fp(
            FingerprintMode::Semantic,
            "/",
            FORM,
            "amount=100&metadata%5Bx%5D=1&currency=usd",
        );
        let b = fp(
            FingerprintMode::Semantic,
            "/",
            FORM,
            "currency=usd&amount=100&metadata[x]=1",
        );
        assert_eq!(a, b);
        assert_ne!(
            fp(FingerprintMode::Semantic, "/", FORM, "tag=a&tag=b"),
            fp(FingerprintMode::Semantic, "/", FORM, "tag=b&tag=a"),
        );
        assert_eq!(
            fp(FingerprintMode::Semantic, "/", FORM, "d=a+b"),
            fp(FingerprintMode::Semantic, "/", FORM, "d=a%20b"),
        );
    }

    #[test]
    fn form_decoding_is_not_lossy() {
        assert_ne!(
            fp(FingerprintMode::Semantic, "/", FORM, "a=%FE"),
            fp(FingerprintMode::Semantic, "/", FORM, "a=%FF"),
        );
    }

    /// The fingerprint of `POST {path}` whose query (`None`: none) and form body (`None`: an
    /// empty body of no declared type) are hashed as raw bytes. This layout is what keeps raw
    /// bytes apart from decoded pairs: a pair count is never `u64::MAX`.
    fn raw_pairs_fingerprint(path: &str, query: Option<&[u8]>, form: Option<&[u8]>) -> Fingerprint {
        let raw_pairs = |hasher: &mut Sha256, bytes: &[u8]| {
            hasher.update(u64::MAX.to_be_bytes());
            hasher.update((bytes.len() as u64).to_be_bytes());
            hasher.update(bytes);
        };
        let mut hasher = Sha256::new();
        hasher.update(b"tower-idempotency/fingerprint/v1\0");
        for field in [&b"POST"[..], path.as_bytes()] {
            hasher.update((field.len() as u64).to_be_bytes());
            hasher.update(field);
        }
        match query {
            Some(query) => raw_pairs(&mut hasher, query),
            None => hasher.update(0u64.to_be_bytes()),
        }
        match form {
            Some(form) => {
                hasher.update(b"form\0");
                raw_pairs(&mut hasher, form);
            }
            None => hasher.update(b"raw\0"),
        }
        Fingerprint(hasher.finalize().into())
    }

    /// `n` pairs with distinct names (`0&1&…&a&b…`, hexadecimal), in order or reversed.
    fn distinct_pairs(n: usize, reversed: bool) -> String {
        let mut pairs: Vec<String> = (0..n).map(|i| format!("{i:x}")).collect();
        if reversed {
            pairs.reverse();
        }
        pairs.join("&")
    }

    #[test]
    fn two_mebibyte_forms_are_hashed_as_their_bytes() {
        // A million pairs of one byte each.
        let repeated = "a&".repeat(1 << 20);
        // Two hundred thousand pairs with distinct names, as a query string would have them.
        let mut query_like = String::new();
        for i in 0.. {
            if query_like.len() >= 2 << 20 {
                break;
            }
            query_like.push_str(&format!("field{i}=value+{i}&"));
        }
        for body in [&repeated, &query_like] {
            assert_eq!(
                fp(FingerprintMode::Semantic, "/", FORM, body),
                raw_pairs_fingerprint("/", None, Some(body.as_bytes())),
            );
        }
        let mut reordered: Vec<&str> = query_like.split('&').collect();
        reordered.reverse();
        assert_ne!(
            fp(FingerprintMode::Semantic, "/", FORM, &query_like),
            fp(FingerprintMode::Semantic, "/", FORM, &reordered.join("&")),
            "the bytes are compared, not the pairs"
        );
    }

    #[test]
    fn ten_thousand_pairs_are_compared_as_pairs_and_more_as_bytes() {
        let form = |body: &str| fp(FingerprintMode::Semantic, "/", FORM, body);
        let most = distinct_pairs(MAX_FORM_PAIRS, false);
        assert_eq!(form(&most), form(&distinct_pairs(MAX_FORM_PAIRS, true)));
        // Empty segments are not pairs.
        assert_eq!(form(&format!("&&{most}&&&")), form(&most));
        let over = distinct_pairs(MAX_FORM_PAIRS + 1, false);
        assert_eq!(
            form(&over),
            raw_pairs_fingerprint("/", None, Some(over.as_bytes()))
        );
        assert_ne!(form(&over), form(&distinct_pairs(MAX_FORM_PAIRS + 1, true)));

        let query = |pairs: &str| fp(FingerprintMode::Semantic, &format!("/x?{pairs}"), None, "");
        assert_eq!(query(&most), query(&distinct_pairs(MAX_FORM_PAIRS, true)));
        assert_eq!(
            query(&over),
            raw_pairs_fingerprint("/x", Some(over.as_bytes()), None)
        );
        assert_ne!(
            query(&over),
            query(&distinct_pairs(MAX_FORM_PAIRS + 1, true))
        );
    }
}
