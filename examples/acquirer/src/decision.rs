//! What the network answers for a card: decided by Stripe's test tokens.
//!
//! | source | outcome |
//! |---|---|
//! | `tok_chargeDeclined` | declined, `generic_decline` |
//! | `tok_chargeDeclinedInsufficientFunds` | declined, `insufficient_funds` |
//! | any other `tok_...` (`tok_visa`, `tok_mastercard`...) | approved |
//!
//! ```
//! use acquirer::{Decision, decide};
//!
//! assert_eq!(decide("tok_visa"), Decision::Approved);
//! let Decision::Declined(decline) = decide("tok_chargeDeclined") else { panic!() };
//! assert_eq!(decline.code, "generic_decline");
//! ```

/// Why a card was declined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decline {
    /// Stripe's `decline_code`, such as `generic_decline`.
    pub code: &'static str,
    /// The message for the customer.
    pub message: &'static str,
}

/// The declines the network knows, one per declining test token.
const DECLINES: [(&str, Decline); 2] = [
    (
        "tok_chargeDeclined",
        Decline {
            code: "generic_decline",
            message: "Your card was declined.",
        },
    ),
    (
        "tok_chargeDeclinedInsufficientFunds",
        Decline {
            code: "insufficient_funds",
            message: "Your card has insufficient funds.",
        },
    ),
];

impl Decline {
    /// The decline of `code` (a `decline_code` this network answers), if it is one.
    pub fn from_code(code: &str) -> Option<Self> {
        DECLINES
            .iter()
            .map(|(_, decline)| *decline)
            .find(|decline| decline.code == code)
    }
}

/// The network's answer for a card.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// The charge may go ahead.
    Approved,
    /// The card was declined.
    Declined(Decline),
}

impl Decision {
    /// The wire `status`: `approved` or `declined`.
    pub fn status(self) -> &'static str {
        match self {
            Self::Approved => "approved",
            Self::Declined(_) => "declined",
        }
    }
}

/// Decides a card from its token; see the [module documentation](self).
pub fn decide(source: &str) -> Decision {
    DECLINES
        .iter()
        .find(|(token, _)| *token == source)
        .map_or(Decision::Approved, |(_, decline)| {
            Decision::Declined(*decline)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_tokens_decide_the_outcome() {
        assert_eq!(decide("tok_visa"), Decision::Approved);
        assert_eq!(decide("tok_mastercard"), Decision::Approved);
        let Decision::Declined(decline) = decide("tok_chargeDeclinedInsufficientFunds") else {
            panic!("declined");
        };
        assert_eq!(decline.code, "insufficient_funds");
        assert_eq!(Decline::from_code("insufficient_funds"), Some(decline));
        assert_eq!(Decline::from_code("stolen_card"), None);
        assert_eq!(decide("tok_chargeDeclined").status(), "declined");
    }
}
