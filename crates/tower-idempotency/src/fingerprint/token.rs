//! JSON strings and numbers, read from the bytes and written in canonical form: each the same
//! as serde_json reads and writes it, so that fingerprints do not change with the reader.

use serde::Serialize;

/// Integers below this magnitude are exact as doubles, so `1.0`, `1e0` and `1` meet there.
const EXACT_INTEGER_LIMIT: f64 = 9_007_199_254_740_992.0; // 2^53

/// A string's end: where its closing quote is, and whether it held an escape.
pub(super) struct StringEnd {
    /// One past the closing quote.
    pub(super) end: usize,
    /// The decoded text differs from the raw bytes (it had escapes).
    pub(super) escaped: bool,
}

/// Reads the string whose opening quote is at `start`, decoding it into `decoded` when it has
/// escapes. `None` when it is not a valid JSON string as serde_json reads one (unescaped
/// control characters, invalid UTF-8, bad escapes or lone surrogates).
pub(super) fn read_string(input: &[u8], start: usize, decoded: &mut Vec<u8>) -> Option<StringEnd> {
    let mut at = start + 1;
    let mut segment = at;
    let mut escaped = false;
    loop {
        let &b = input.get(at)?;
        match b {
            b'"' => break,
            b'\\' => {
                if !escaped {
                    escaped = true;
                    decoded.clear();
                }
                decoded.extend_from_slice(utf8(&input[segment..at])?);
                at = unescape(input, at + 1, decoded)?;
                segment = at;
            }
            0..=0x1f => return None,
            _ => at += 1,
        }
    }
    let tail = utf8(&input[segment..at])?;
    if escaped {
        decoded.extend_from_slice(tail);
    }
    Some(StringEnd {
        end: at + 1,
        escaped,
    })
}

fn utf8(bytes: &[u8]) -> Option<&[u8]> {
    std::str::from_utf8(bytes).ok().map(str::as_bytes)
}

/// Decodes the escape after a backslash at `at` into `decoded`; returns where it ends.
fn unescape(input: &[u8], at: usize, decoded: &mut Vec<u8>) -> Option<usize> {
    let byte = match *input.get(at)? {
        b'"' => b'"',
        b'\\' => b'\\',
        b'/' => b'/',
        b'b' => 0x08,
        b'f' => 0x0c,
        b'n' => b'\n',
        b'r' => b'\r',
        b't' => b'\t',
        b'u' => return unicode_escape(input, at + 1, decoded),
        _ => return None,
    };
    decoded.push(byte);
    Some(at + 1)
}

/// `\uXXXX`, or a surrogate pair `\uD83D\uDE00`; a lone surrogate is an error, as in serde_json.
fn unicode_escape(input: &[u8], at: usize, decoded: &mut Vec<u8>) -> Option<usize> {
    let unit = hex4(input, at)?;
    let (code, end) = match unit {
        0xDC00..=0xDFFF => return None,
        0xD800..=0xDBFF => {
            if input.get(at + 4..at + 6)? != b"\\u" {
                return None;
            }
            let low = hex4(input, at + 6)?;
            if !(0xDC00..=0xDFFF).contains(&low) {
                return None;
            }
            let code = (((u32::from(unit) - 0xD800) << 10) | (u32::from(low) - 0xDC00)) + 0x1_0000;
            (code, at + 10)
        }
        _ => (u32::from(unit), at + 4),
    };
    let c = char::from_u32(code)?;
    decoded.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
    Some(end)
}

fn hex4(input: &[u8], at: usize) -> Option<u16> {
    let digits = input.get(at..at + 4)?;
    digits.iter().try_fold(0u16, |n, &d| {
        let v = (d as char).to_digit(16)?;
        Some((n << 4) | v as u16)
    })
}

/// Appends a decoded string quoted and minimally escaped, as serde_json writes it: `"` and
/// `\\` escaped, control characters as `\b \t \n \f \r` or `\u00xx`, nothing else.
pub(super) fn write_string(out: &mut Vec<u8>, decoded: &[u8]) {
    // Unescaped runs are copied whole: one call per escape, not one per string through serde.
    out.push(b'"');
    let mut run = 0;
    for (at, &b) in decoded.iter().enumerate() {
        let escape: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0x08 => b"\\b",
            b'\t' => b"\\t",
            b'\n' => b"\\n",
            0x0c => b"\\f",
            b'\r' => b"\\r",
            0..=0x1f => {
                out.extend_from_slice(&decoded[run..at]);
                let hex = b"0123456789abcdef";
                out.extend_from_slice(b"\\u00");
                out.extend_from_slice(&[hex[usize::from(b >> 4)], hex[usize::from(b & 0xf)]]);
                run = at + 1;
                continue;
            }
            _ => continue,
        };
        out.extend_from_slice(&decoded[run..at]);
        out.extend_from_slice(escape);
        run = at + 1;
    }
    out.extend_from_slice(&decoded[run..]);
    out.push(b'"');
}

/// The parts of a number token: `-?int(.frac)?([eE]exp)?`.
pub(super) struct Number {
    pub(super) end: usize,
    negative: bool,
    int_digits: usize,
    frac_digits: usize,
    exponent: bool,
}

/// Reads the number at `start` by JSON's grammar; `None` when it is not one.
#[inline]
pub(super) fn read_number(input: &[u8], start: usize) -> Option<Number> {
    let negative = input.get(start) == Some(&b'-');
    let int_start = start + usize::from(negative);
    let mut at = int_start;
    match input.get(at)? {
        b'0' => at += 1,
        b'1'..=b'9' => at = digits_end(input, at + 1),
        _ => return None,
    }
    let int_digits = at - int_start;
    let mut frac_digits = 0;
    if input.get(at) == Some(&b'.') {
        let end = digits_end(input, at + 1);
        frac_digits = end - at - 1;
        if frac_digits == 0 {
            return None;
        }
        at = end;
    }
    let exponent = matches!(input.get(at), Some(b'e' | b'E'));
    if exponent {
        at += 1;
        if matches!(input.get(at), Some(b'+' | b'-')) {
            at += 1;
        }
        let end = digits_end(input, at);
        if end == at {
            return None;
        }
        at = end;
    }
    Some(Number {
        end: at,
        negative,
        int_digits,
        frac_digits,
        exponent,
    })
}

#[inline]
fn digits_end(input: &[u8], mut at: usize) -> usize {
    while input.get(at).is_some_and(u8::is_ascii_digit) {
        at += 1;
    }
    at
}

impl Number {
    /// Whether the token is already its own canonical form, decided from its shape alone:
    /// an integer short enough for `i64`/`u64` (not `-0`), or a decimal of at most 15
    /// significant digits (so exactly one double's shortest form) without a trailing zero,
    /// in the range written without an exponent.
    #[inline]
    pub(super) fn is_canonical(&self, token: &[u8]) -> bool {
        if self.exponent {
            return false;
        }
        let digits = &token[usize::from(self.negative)..];
        if self.frac_digits == 0 {
            return self.int_digits <= 18 && !(self.negative && digits == b"0");
        }
        let frac = &digits[self.int_digits + 1..];
        if frac.last() == Some(&b'0') {
            return false;
        }
        let significant = if digits[0] == b'0' {
            let zeros = frac.iter().take_while(|&&d| d == b'0').count();
            if zeros > 2 {
                return false;
            }
            self.frac_digits - zeros
        } else {
            self.int_digits + self.frac_digits
        };
        significant <= 15
    }

    /// Appends the canonical form of the number `token`: integers that fit `u64` or `i64`
    /// exactly, integral doubles below 2^53 as integers, other doubles in their shortest
    /// round-trip form. `None` when it is out of a double's range.
    pub(super) fn write_canonical(&self, token: &[u8], out: &mut Vec<u8>) -> Option<()> {
        if self.exponent && self.write_small_integral(token, out) {
            return Some(());
        }
        let text = std::str::from_utf8(token).ok()?;
        if !self.exponent && self.frac_digits == 0 {
            // serde_json reads `-0` as the double -0.0, written `0` like every integral double.
            if !self.negative
                && let Ok(n) = text.parse::<u64>()
            {
                write_json(out, &n);
                return Some(());
            } else if self.negative
                && text != "-0"
                && let Ok(n) = text.parse::<i64>()
            {
                write_json(out, &n);
                return Some(());
            }
        }
        let v: f64 = text.parse().ok()?;
        if !v.is_finite() {
            return None;
        }
        if v.fract() == 0.0 && v.abs() < EXACT_INTEGER_LIMIT {
            write_json(out, &(v as i64));
        } else {
            write_json(out, &v);
        }
        Some(())
    }
}

impl Number {
    /// Appends a token with an exponent whose value is an integer of at most 15 digits
    /// (`5e3`, `1.25e2`) as that integer, without parsing and formatting a double: such a
    /// value is exact as one, and written as an integer. `false`: not such a token.
    fn write_small_integral(&self, token: &[u8], out: &mut Vec<u8>) -> bool {
        let sign = usize::from(self.negative);
        let int = &token[sign..sign + self.int_digits];
        let frac_start = sign + self.int_digits + 1;
        let frac = token
            .get(frac_start..frac_start + self.frac_digits)
            .unwrap_or_default();
        let exp_start = sign
            + self.int_digits
            + if self.frac_digits > 0 {
                1 + self.frac_digits
            } else {
                0
            }
            + 1;
        let exp = &token[exp_start..];
        let exp = exp.strip_prefix(b"+").unwrap_or(exp);
        // At most three digits: a larger or negative exponent takes the general path.
        if exp.len() > 3 || exp.first() == Some(&b'-') {
            return false;
        }
        let exp = exp
            .iter()
            .fold(0usize, |n, d| n * 10 + usize::from(d - b'0'));
        let Some(zeros) = exp.checked_sub(self.frac_digits) else {
            return false;
        };
        let leading = int.iter().chain(frac).take_while(|&&d| d == b'0').count();
        let significant = self.int_digits + self.frac_digits - leading;
        if significant == 0 {
            // Zero, or minus zero, is written `0`.
            out.push(b'0');
            return true;
        }
        if significant + zeros > 15 {
            return false;
        }
        if self.negative {
            out.push(b'-');
        }
        // Leading zeros are all in `int` unless it is `0`, when they run on into `frac`.
        let (int, frac) = match int.get(leading..) {
            Some(rest) => (rest, frac),
            None => (&[][..], &frac[leading - int.len()..]),
        };
        out.extend_from_slice(int);
        out.extend_from_slice(frac);
        out.resize(out.len() + zeros, b'0');
        true
    }
}

/// Appends a number or string as serde_json writes it.
fn write_json<T: Serialize + ?Sized>(out: &mut Vec<u8>, value: &T) {
    // Serialising a number or `str` into a `Vec` cannot fail.
    let _ = value.serialize(&mut serde_json::Serializer::new(out));
}
