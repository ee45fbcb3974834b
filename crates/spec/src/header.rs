//! Prototypes from a plain C header (the Khronos `cl.h`), for the coverage table and for a
//! provisional spec (CAvA's first step: every function, with safe defaults to refine).

use crate::lex::{lex, Tok};

/// A function prototype found in a header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prototype {
    pub name: String,
    /// The prototype's text with macros removed, on one line.
    pub text: String,
}

const NOISE: &[&str] = &["extern", "CL_API_ENTRY", "CL_API_CALL", "CL_CALLBACK"];

/// Every `extern CL_API_ENTRY ... CL_API_CALL name(...)` prototype of a header, in order.
/// Preprocessor lines are skipped; suffix macros (`CL_API_SUFFIX__*`, `CL_EXT_*`) dropped.
pub fn prototypes(header: &str) -> Vec<Prototype> {
    let cleaned: String = header
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let cleaned = strip_block_comments(&cleaned);
    let mut out = Vec::new();
    for stmt in cleaned.split(';') {
        let Some(at) = stmt.find("CL_API_ENTRY") else {
            continue;
        };
        let body = &stmt[at..];
        if !body.contains("CL_API_CALL") || body.contains("typedef") {
            continue;
        }
        let words: Vec<&str> = body
            .split_whitespace()
            .filter(|w| {
                !NOISE.contains(w) && !w.starts_with("CL_API_SUFFIX") && !w.starts_with("CL_EXT_")
            })
            .collect();
        let text = words.join(" ").replace("( ", "(").replace(" )", ")");
        let Ok(toks) = lex(&text.replace(['&', '.', ':'], " ")) else {
            continue;
        };
        let name = toks.windows(2).find_map(|w| match (&w[0].tok, &w[1].tok) {
            (Tok::Ident(n), Tok::Punct('(')) => Some(n.clone()),
            _ => None,
        });
        if let Some(name) = name {
            out.push(Prototype { name, text });
        }
    }
    out
}

fn strip_block_comments(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find("/*") {
        out.push_str(&rest[..i]);
        rest = rest[i + 2..]
            .find("*/")
            .map_or("", |j| &rest[i + 2 + j + 2..]);
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_prototypes_and_drops_macros() {
        let h = "/* c */\n#define X 1\nextern CL_API_ENTRY cl_int CL_API_CALL\nclFinish(cl_command_queue q) CL_API_SUFFIX__VERSION_1_0;\ntypedef int x;";

        let p = prototypes(h);

        assert_eq!(p.len(), 1);
        assert_eq!(p[0].name, "clFinish");
        assert_eq!(p[0].text, "cl_int clFinish(cl_command_queue q)");
    }
}
