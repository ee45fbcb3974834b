//! The API spec language: C prototypes extended with LAPIS-style descriptors (AvA §5.4.1),
//! its model and its parser. [`parse`] reads a spec; [`header::prototypes`] reads plain C
//! headers so a spec can be checked against (or started from) the vendor's header.
#![forbid(unsafe_code)]

pub mod header;
mod lex;
mod model;
mod parse;

pub use model::*;
pub use parse::parse;

/// Errors of the spec parser.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    #[error("line {line}: {msg}")]
    Syntax { line: usize, msg: String },
    #[error("{func}: {msg}")]
    Semantic { func: String, msg: String },
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, Error>;
