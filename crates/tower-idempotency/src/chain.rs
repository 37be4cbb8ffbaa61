//! An error with the errors behind it, on one line, for logs.

use std::{error::Error as StdError, fmt};

/// Displays an error with its sources: `outer: inner: innermost`, skipping a source that only
/// repeats what its parent said (sqlx's database errors display their source's message).
pub(crate) struct Chain<'a>(pub(crate) &'a (dyn StdError + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut said = self.0.to_string();
        f.write_str(&said)?;
        let mut source = self.0.source();
        while let Some(error) = source {
            let message = error.to_string();
            if !said.ends_with(&message) {
                write!(f, ": {message}")?;
            }
            said = message;
            source = error.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Layered(&'static str, Option<Box<Layered>>);

    impl fmt::Display for Layered {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.0)
        }
    }

    impl StdError for Layered {
        fn source(&self) -> Option<&(dyn StdError + 'static)> {
            self.1.as_deref().map(|e| e as &(dyn StdError + 'static))
        }
    }

    #[test]
    fn error_chains_show_each_new_message_once() {
        let error = Layered(
            "store failed",
            Some(Box::new(Layered(
                "database said: relation missing",
                Some(Box::new(Layered("relation missing", None))),
            ))),
        );
        assert_eq!(
            Chain(&error).to_string(),
            "store failed: database said: relation missing"
        );
    }
}
