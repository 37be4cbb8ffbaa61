//! Medians and how figures are written: rates, durations, sizes, ratios.

/// The median; the mean of the two middle values for an even count.
pub(super) fn median(values: impl Iterator<Item = f64>) -> Option<f64> {
    let mut values: Vec<f64> = values.filter(|v| v.is_finite()).collect();
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    Some(if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    })
}

pub(super) fn with_ratio(value: Option<String>, ratio: Option<f64>) -> String {
    match (value, ratio) {
        (Some(value), Some(ratio)) => format!("{value} ({ratio:.2}×)"),
        (Some(value), None) => value,
        (None, _) => "—".to_owned(),
    }
}

/// `12,345`.
pub(crate) fn format_rate(rate: f64) -> String {
    let digits = format!("{:.0}", rate.max(0.0));
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, digit) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(digit);
    }
    out
}

/// `850 µs`, `4.21 ms`, `12.3 ms`, `1.20 s`.
pub(crate) fn format_micros(micros: f64) -> String {
    if micros < 1_000.0 {
        format!("{micros:.0} µs")
    } else if micros < 10_000.0 {
        format!("{:.2} ms", micros / 1e3)
    } else if micros < 1_000_000.0 {
        format!("{:.1} ms", micros / 1e3)
    } else {
        format!("{:.2} s", micros / 1e6)
    }
}

/// `45.2 MiB`.
pub(crate) fn format_bytes(bytes: f64) -> String {
    format!("{:.1} MiB", bytes / (1024.0 * 1024.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        assert_eq!(median([3.0, 1.0, 2.0].into_iter()), Some(2.0));
        assert_eq!(median([4.0, 1.0, 2.0, 3.0].into_iter()), Some(2.5));
        assert_eq!(median(std::iter::empty()), None);
    }

    #[test]
    fn formats() {
        assert_eq!(format_rate(1_234_567.4), "1,234,567");
        assert_eq!(format_rate(999.0), "999");
        assert_eq!(format_micros(850.0), "850 µs");
        assert_eq!(format_micros(4_210.0), "4.21 ms");
        assert_eq!(format_micros(12_340.0), "12.3 ms");
        assert_eq!(format_bytes(1.5 * 1024.0 * 1024.0), "1.5 MiB");
    }
}
