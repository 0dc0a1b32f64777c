//! The error plumbing every moeswarm library crate shares, written once.
//!
//! Each library has its own error enum: the kinds of failure its callers match on.
//! [`context_error!`](crate::context_error) declares it with two more variants every one of
//! them needs, `Invalid(String)` (input or state that breaks a rule, the message says which)
//! and `Context { context, source }` (a failure and what was being done when it happened),
//! and adds the `Result` alias, `Error::invalid`, `Error::root` (the innermost kind, under the
//! context), the `Context` trait (`.context(..)` / `.with_context(..)` on results and
//! options) and a crate-local `bail!`. Pure code: no I/O, like the rest of this crate.

/// Declares the calling crate's error enum, given its own variants, with the shared ones and
/// the shared plumbing (see the module docs). Call it once, in the crate's `error` module.
// `bail!` names the calling crate's `crate::error` on purpose: it is that crate's macro.
#[allow(clippy::crate_in_macro_def)]
#[macro_export]
macro_rules! context_error {
    (
        $(#[$meta:meta])*
        pub enum $error:ident { $($variants:tt)* }
    ) => {
        $(#[$meta])*
        pub enum $error {
            $($variants)*
            /// Input, a peer's answer or a state that breaks a rule; the message says which.
            #[error("{0}")]
            Invalid(String),
            /// `source`, met while doing `context` (the message holds both).
            #[error("{context}: {source}")]
            Context {
                /// What was being done.
                context: String,
                /// What went wrong.
                source: Box<$error>,
            },
        }
        $crate::context_error!(@with $error, $);
    };
    (@with $error:ident, $d:tt) => {
        /// `Result` with this crate's error.
        pub type Result<T, E = $error> = std::result::Result<T, E>;

        impl $error {
            /// An error that says what was wrong (input that breaks a rule, a state that
            /// forbids it).
            pub fn invalid(message: impl std::fmt::Display) -> Self {
                $error::Invalid(message.to_string())
            }

            /// The innermost error, under every layer of context: the one to match on.
            pub fn root(&self) -> &$error {
                match self {
                    $error::Context { source, .. } => source.root(),
                    other => other,
                }
            }

            fn wrap(context: impl std::fmt::Display, source: impl Into<$error>) -> Self {
                $error::Context {
                    context: context.to_string(),
                    source: Box::new(source.into()),
                }
            }
        }

        /// Adds context to a failure: what was being done when it happened.
        pub trait Context<T> {
            /// Wraps the error with `context`.
            fn context<C: std::fmt::Display>(self, context: C) -> Result<T>;
            /// Wraps the error with the context `f` gives (computed only on failure).
            fn with_context<C: std::fmt::Display>(self, f: impl FnOnce() -> C) -> Result<T>;
        }

        impl<T, E: Into<$error>> Context<T> for std::result::Result<T, E> {
            fn context<C: std::fmt::Display>(self, context: C) -> Result<T> {
                self.map_err(|e| $error::wrap(context, e))
            }

            fn with_context<C: std::fmt::Display>(self, f: impl FnOnce() -> C) -> Result<T> {
                self.map_err(|e| $error::wrap(f(), e))
            }
        }

        impl<T> Context<T> for Option<T> {
            fn context<C: std::fmt::Display>(self, context: C) -> Result<T> {
                self.ok_or_else(|| $error::invalid(context))
            }

            fn with_context<C: std::fmt::Display>(self, f: impl FnOnce() -> C) -> Result<T> {
                self.ok_or_else(|| $error::invalid(f()))
            }
        }

        /// Returns early with the `Invalid` error and a formatted message.
        macro_rules! bail {
            ($d($d arg:tt)*) => {
                return Err(crate::error::$error::Invalid(format!($d($d arg)*)))
            };
        }
        #[allow(unused_imports)]
        pub(crate) use bail;
    };
}

/// A crate error as the libraries write them, for this module's tests (the macro wants it at
/// `crate::error`).
#[cfg(test)]
pub(crate) mod test_error {
    crate::context_error! {
        /// A failure of the test.
        #[derive(Debug, thiserror::Error)]
        pub enum Error {
            /// Not a number.
            #[error(transparent)]
            Parse(#[from] std::num::ParseIntError),
        }
    }

    pub fn parse(s: &str) -> Result<u32> {
        let n: u32 = s.parse().with_context(|| format!("reading {s:?}"))?;
        if n == 0 {
            bail!("{s:?} is zero");
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use crate::error::{parse, Context, Error};

    #[test]
    fn context_is_in_the_message_and_the_root_keeps_its_kind() {
        let e = parse("x1").unwrap_err();
        assert!(e.to_string().starts_with("reading \"x1\": "), "{e}");
        assert!(matches!(e.root(), Error::Parse(_)));
        let e = parse("0").unwrap_err();
        assert_eq!(e.to_string(), "\"0\" is zero");
        assert_eq!(parse("7").unwrap(), 7);
        let none: Option<u8> = None;
        assert_eq!(none.context("nothing").unwrap_err().to_string(), "nothing");
    }
}
