//! Tokens of the spec language (a C-like lexer; `#` starts a comment).

use crate::{Error, Result};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Tok {
    Ident(String),
    Num(i64),
    Punct(char),
}

#[derive(Clone, Debug)]
pub struct Token {
    pub tok: Tok,
    pub line: usize,
}

pub fn lex(src: &str) -> Result<Vec<Token>> {
    let mut out = Vec::new();
    for (i, raw) in src.lines().enumerate() {
        let line = i + 1;
        let text = raw.split('#').next().unwrap_or("");
        let b = text.as_bytes();
        let mut p = 0;
        while p < b.len() {
            let c = b[p] as char;
            if c.is_whitespace() {
                p += 1;
            } else if c.is_ascii_alphabetic() || c == '_' {
                let s = p;
                while p < b.len() && ((b[p] as char).is_ascii_alphanumeric() || b[p] == b'_') {
                    p += 1;
                }
                out.push(Token {
                    tok: Tok::Ident(text[s..p].to_string()),
                    line,
                });
            } else if c.is_ascii_digit()
                || (c == '-' && p + 1 < b.len() && b[p + 1].is_ascii_digit())
            {
                let s = p;
                p += 1;
                while p < b.len() && (b[p] as char).is_ascii_alphanumeric() {
                    p += 1;
                }
                let t = &text[s..p];
                let (neg, body) = t.strip_prefix('-').map_or((false, t), |r| (true, r));
                let v = match body.strip_prefix("0x").or_else(|| body.strip_prefix("0X")) {
                    Some(hex) => i64::from_str_radix(hex, 16),
                    None => body.trim_end_matches(['u', 'U', 'l', 'L']).parse::<i64>(),
                }
                .map_err(|e| Error::Syntax {
                    line,
                    msg: format!("bad number {t}: {e}"),
                })?;
                out.push(Token {
                    tok: Tok::Num(if neg { -v } else { v }),
                    line,
                });
            } else if "()[]{},;*=+".contains(c) {
                out.push(Token {
                    tok: Tok::Punct(c),
                    line,
                });
                p += 1;
            } else {
                return Err(Error::Syntax {
                    line,
                    msg: format!("unexpected character {c:?}"),
                });
            }
        }
    }
    Ok(out)
}
