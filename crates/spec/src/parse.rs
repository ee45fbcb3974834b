//! The spec parser.

use crate::lex::{lex, Tok, Token};
use crate::model::*;
use crate::{Error, Result};

struct P {
    toks: Vec<Token>,
    pos: usize,
}

impl P {
    fn line(&self) -> usize {
        self.toks
            .get(self.pos)
            .or(self.toks.last())
            .map_or(0, |t| t.line)
    }
    fn err<T>(&self, msg: impl Into<String>) -> Result<T> {
        Err(Error::Syntax {
            line: self.line(),
            msg: msg.into(),
        })
    }
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos).map(|t| &t.tok)
    }
    fn peek_at(&self, n: usize) -> Option<&Tok> {
        self.toks.get(self.pos + n).map(|t| &t.tok)
    }
    fn next(&mut self) -> Option<Tok> {
        let t = self.toks.get(self.pos).map(|t| t.tok.clone());
        self.pos += 1;
        t
    }
    fn is_punct(&self, c: char) -> bool {
        self.peek() == Some(&Tok::Punct(c))
    }
    fn eat(&mut self, c: char) -> bool {
        let yes = self.is_punct(c);
        if yes {
            self.pos += 1;
        }
        yes
    }
    fn expect(&mut self, c: char) -> Result<()> {
        if self.eat(c) {
            Ok(())
        } else {
            self.err(format!("expected '{c}', found {:?}", self.peek()))
        }
    }
    fn ident(&mut self) -> Result<String> {
        match self.next() {
            Some(Tok::Ident(s)) => Ok(s),
            other => {
                self.pos -= 1;
                self.err(format!("expected a name, found {other:?}"))
            }
        }
    }
    fn num(&mut self) -> Result<i64> {
        match self.next() {
            Some(Tok::Num(n)) => Ok(n),
            other => {
                self.pos -= 1;
                self.err(format!("expected a number, found {other:?}"))
            }
        }
    }

    fn expr(&mut self) -> Result<Expr> {
        let mut lhs = self.term()?;
        while self.eat('+') {
            lhs = Expr::Add(Box::new(lhs), Box::new(self.term()?));
        }
        Ok(lhs)
    }
    fn term(&mut self) -> Result<Expr> {
        let mut lhs = self.atom()?;
        while self.eat('*') {
            lhs = Expr::Mul(Box::new(lhs), Box::new(self.atom()?));
        }
        Ok(lhs)
    }
    fn atom(&mut self) -> Result<Expr> {
        match self.next() {
            Some(Tok::Num(n)) => Ok(Expr::Num(n)),
            Some(Tok::Ident(name)) if self.is_punct('(') => {
                self.pos += 1;
                let mut args = Vec::new();
                while !self.eat(')') {
                    args.push(self.expr()?);
                    self.eat(',');
                }
                Ok(Expr::Call(name, args))
            }
            Some(Tok::Ident(name)) => Ok(Expr::Var(name)),
            Some(Tok::Punct('(')) => {
                let e = self.expr()?;
                self.expect(')')?;
                Ok(e)
            }
            other => {
                self.pos -= 1;
                self.err(format!("expected an expression, found {other:?}"))
            }
        }
    }

    /// `name` or `name(args)` inside a descriptor list.
    fn descriptor(&mut self) -> Result<(String, Vec<Expr>)> {
        let name = self.ident()?;
        let mut args = Vec::new();
        if self.eat('(') {
            while !self.eat(')') {
                args.push(self.expr()?);
                self.eat(',');
            }
        }
        Ok((name, args))
    }
    fn descriptors(&mut self) -> Result<Vec<(String, Vec<Expr>)>> {
        let mut out = Vec::new();
        if self.eat('[') {
            while !self.eat(']') {
                out.push(self.descriptor()?);
                self.eat(',');
            }
        }
        Ok(out)
    }

    /// A C type followed by a name: `const char **strings`.
    fn typed_name(&mut self) -> Result<(CType, String)> {
        let mut is_const = false;
        let mut words = Vec::new();
        let mut ptrs = 0u8;
        loop {
            match self.peek() {
                Some(Tok::Ident(s)) if s == "const" => {
                    is_const = true;
                    self.pos += 1;
                }
                Some(Tok::Ident(_)) => words.push(self.ident()?),
                Some(Tok::Punct('*')) => {
                    ptrs += 1;
                    self.pos += 1;
                }
                _ => break,
            }
        }
        if words.len() < 2 {
            return self.err(format!("expected a type and a name, found {words:?}"));
        }
        let name = words.pop().expect("checked: at least two words");
        let base = words.join("_");
        Ok((
            CType {
                base,
                ptrs,
                is_const,
            },
            name,
        ))
    }
}

fn arg_var(f: &str, args: &[Expr], i: usize) -> Result<String> {
    match args.get(i) {
        Some(Expr::Var(v)) => Ok(v.clone()),
        other => Err(Error::Semantic {
            func: f.into(),
            msg: format!("expected a name, found {other:?}"),
        }),
    }
}

fn arg_expr(f: &str, args: &[Expr], i: usize) -> Result<Expr> {
    args.get(i).cloned().ok_or_else(|| Error::Semantic {
        func: f.into(),
        msg: "missing argument".into(),
    })
}

fn param_kind(func: &str, ty: &CType, descs: &[(String, Vec<Expr>)]) -> Result<ParamKind> {
    let has = |n: &str| descs.iter().any(|(d, _)| d == n);
    let out = has("out");
    for (d, args) in descs {
        let k = match d.as_str() {
            "element" if out => ParamKind::OutElement,
            "element" => ParamKind::InElement,
            "array" if out => ParamKind::OutArray(arg_expr(func, args, 0)?),
            "array" => ParamKind::InArray(arg_expr(func, args, 0)?),
            "buffer" if out => ParamKind::OutBuffer {
                len: arg_expr(func, args, 0)?,
                info: has("info"),
            },
            "buffer" => ParamKind::InBuffer(arg_expr(func, args, 0)?),
            "string" => ParamKind::String,
            "strings" => {
                let lengths = arg_var(func, args, 1)?;
                ParamKind::Strings {
                    count: arg_expr(func, args, 0)?,
                    lengths: (lengths != "none").then_some(lengths),
                }
            }
            "properties" => ParamKind::Properties {
                context: matches!(args.first(), Some(Expr::Var(v)) if v == "context"),
            },
            "host_buffer" => ParamKind::HostBuffer {
                flags: arg_var(func, args, 0)?,
                len: arg_expr(func, args, 1)?,
            },
            "image_desc" => ParamKind::ImageDesc,
            "kernel_arg" => ParamKind::KernelArg(arg_expr(func, args, 0)?),
            "errcode" => ParamKind::Errcode,
            "user_data" => ParamKind::UserData,
            "callback" => {
                let kind = match arg_var(func, args, 0)?.as_str() {
                    "context_notify" => CallbackKind::ContextNotify,
                    "program_notify" => CallbackKind::ProgramNotify,
                    "event_notify" => CallbackKind::EventNotify,
                    "object_notify" => CallbackKind::ObjectNotify,
                    other => {
                        return Err(Error::Semantic {
                            func: func.into(),
                            msg: format!("unknown callback kind {other}"),
                        })
                    }
                };
                ParamKind::Callback {
                    kind,
                    user_data: arg_var(func, args, 1)?,
                }
            }
            "in" | "out" | "info" => continue,
            other => {
                return Err(Error::Semantic {
                    func: func.into(),
                    msg: format!("unknown descriptor {other}"),
                })
            }
        };
        return Ok(k);
    }
    if ty.ptrs == 0 {
        Ok(ParamKind::Value)
    } else {
        // A pointer without descriptors is only allowed in functions that are not forwarded.
        Ok(ParamKind::Value)
    }
}

fn function(p: &mut P, opcode: u16) -> Result<Function> {
    let line = p.line();
    let (ret, name) = p.typed_name()?;
    p.expect('(')?;
    let mut params = Vec::new();
    while !p.eat(')') {
        let (ty, pname) = p.typed_name()?;
        let descs = p.descriptors()?;
        let kind = param_kind(&name, &ty, &descs)?;
        params.push(Param {
            name: pname,
            ty,
            kind,
        });
        p.eat(',');
    }
    let mut f = Function {
        name,
        ret,
        params,
        forward: Forward::Sync,
        custom: Custom::None,
        force_blocking: None,
        creates: None,
        retains: false,
        releases: false,
        allocates: None,
        device_time: false,
        resident: false,
        opcode,
        line,
    };
    for (d, args) in p.descriptors()? {
        match d.as_str() {
            "sync" => f.forward = Forward::Sync,
            "async" => f.forward = Forward::Async,
            "async_unless" => f.forward = Forward::AsyncUnless(arg_var(&f.name, &args, 0)?),
            "unsupported" => {
                let e = args
                    .first()
                    .map_or(Ok("CL_INVALID_OPERATION".to_string()), |_| {
                        arg_var(&f.name, &args, 0)
                    })?;
                f.forward = Forward::Unsupported(e)
            }
            "guest_only" => f.forward = Forward::GuestOnly,
            "custom" => f.custom = Custom::Both,
            "custom_server" => f.custom = Custom::Server,
            "custom_guest" => f.custom = Custom::Guest,
            "force_blocking" => f.force_blocking = Some(arg_var(&f.name, &args, 0)?),
            "creates" => f.creates = Some(arg_var(&f.name, &args, 0)?),
            "retains" => f.retains = true,
            "releases" => f.releases = true,
            "allocates" => f.allocates = Some(arg_expr(&f.name, &args, 0)?),
            "device_time" => f.device_time = true,
            "resident" => f.resident = true,
            other => {
                return Err(Error::Semantic {
                    func: f.name,
                    msg: format!("unknown function descriptor {other}"),
                })
            }
        }
    }
    p.expect(';')?;
    Ok(f)
}

/// Parse a spec and check that every name it uses is declared.
pub fn parse(src: &str) -> Result<Spec> {
    let mut p = P {
        toks: lex(src)?,
        pos: 0,
    };
    let mut spec = Spec::default();
    while let Some(tok) = p.peek().cloned() {
        match tok {
            Tok::Ident(w) if w == "handle" => {
                p.pos += 1;
                let ctype = p.ident()?;
                let kind = p.ident()?;
                let invalid_name = p.ident()?;
                p.expect('=')?;
                let invalid = p.num()? as i32;
                p.expect(';')?;
                spec.handles.push(HandleType {
                    ctype,
                    kind,
                    invalid_name,
                    invalid,
                });
            }
            Tok::Ident(w) if w == "scalar" => {
                p.pos += 1;
                let ctype = p.ident()?;
                let prim = p.ident()?;
                p.expect(';')?;
                spec.scalars.push(ScalarType { ctype, prim });
            }
            Tok::Ident(w) if w == "info" && matches!(p.peek_at(1), Some(Tok::Ident(_))) => {
                p.pos += 1;
                let function = p.ident()?;
                let value = p.num()? as u32;
                let name = p.ident()?;
                let mode = match p.ident()?.as_str() {
                    "handle" => InfoMode::Handle,
                    "handles" => InfoMode::Handles,
                    "properties" => InfoMode::Properties,
                    "guest" => InfoMode::Guest,
                    other => return p.err(format!("unknown info mode {other}")),
                };
                let ctype = p.ident()?;
                p.expect(';')?;
                spec.infos.push(InfoDecl {
                    function,
                    value,
                    name,
                    mode,
                    ctype,
                });
            }
            Tok::Ident(w) if w == "dispatch" => {
                p.pos += 1;
                p.expect('{')?;
                while !p.eat('}') {
                    spec.dispatch.push(p.ident()?);
                }
            }
            _ => {
                let opcode =
                    u16::try_from(spec.functions.len() + 1).map_err(|_| Error::Syntax {
                        line: p.line(),
                        msg: "too many functions".into(),
                    })?;
                let f = function(&mut p, opcode)?;
                spec.functions.push(f);
            }
        }
    }
    check(&spec)?;
    Ok(spec)
}

fn check(spec: &Spec) -> Result<()> {
    let sem = |f: &Function, msg: String| {
        Err(Error::Semantic {
            func: f.name.clone(),
            msg,
        })
    };
    for f in &spec.functions {
        for t in std::iter::once(&f.ret).chain(f.params.iter().map(|p| &p.ty)) {
            if spec.size_of(&t.base).is_none() {
                return sem(f, format!("undeclared type {}", t.base));
            }
        }
        if !f.is_forwarded() || f.custom == Custom::Both {
            continue;
        }
        for p in &f.params {
            let mut vars = Vec::new();
            match &p.kind {
                ParamKind::InArray(e)
                | ParamKind::OutArray(e)
                | ParamKind::InBuffer(e)
                | ParamKind::KernelArg(e) => e.vars(&mut vars),
                ParamKind::OutBuffer { len, .. } => len.vars(&mut vars),
                ParamKind::HostBuffer { flags, len } => {
                    vars.push(flags.clone());
                    len.vars(&mut vars)
                }
                ParamKind::Strings { count, lengths } => {
                    count.vars(&mut vars);
                    vars.extend(lengths.iter().cloned());
                }
                ParamKind::Callback { user_data, .. } => vars.push(user_data.clone()),
                ParamKind::Value if p.ty.ptrs > 0 && p.ty.base != "void" => {
                    return sem(f, format!("pointer parameter {} needs descriptors", p.name))
                }
                _ => {}
            }
            if let Some(v) = vars.iter().find(|v| f.param(v).is_none()) {
                return sem(f, format!("{} refers to unknown parameter {v}", p.name));
            }
        }
        if let Some(c) = &f.creates {
            if spec.handle_kind(c).is_none() {
                return sem(f, format!("creates unknown kind {c}"));
            }
        }
    }
    for name in &spec.dispatch {
        if spec.function(name).is_none() {
            return Err(Error::Semantic {
                func: name.clone(),
                msg: "in dispatch but not declared".into(),
            });
        }
    }
    for i in &spec.infos {
        if spec.function(&i.function).is_none() {
            return Err(Error::Semantic {
                func: i.function.clone(),
                msg: "info for an undeclared function".into(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINI: &str = r#"
        handle cl_mem mem CL_INVALID_MEM_OBJECT = -38;
        scalar cl_int i32; scalar size_t usize; scalar void u8; scalar cl_uint u32;
        cl_int clGetMemObjectInfo(cl_mem memobj, cl_uint param_name, size_t param_value_size,
            void *param_value [out, buffer(param_value_size), info],
            size_t *param_value_size_ret [out, element]) [sync];
        cl_int clReleaseMemObject(cl_mem memobj) [async, releases];
        dispatch { clGetMemObjectInfo clReleaseMemObject }
    "#;

    #[test]
    fn parses_prototypes_with_descriptors() {
        let spec = parse(MINI).expect("valid spec");

        let f = spec.function("clGetMemObjectInfo").expect("declared");

        assert_eq!(f.opcode, 1);
        assert_eq!(
            f.params[3].kind,
            ParamKind::OutBuffer {
                len: Expr::Var("param_value_size".into()),
                info: true
            }
        );
        assert_eq!(f.params[4].kind, ParamKind::OutElement);
        assert_eq!(
            spec.function("clReleaseMemObject")
                .map(|f| f.forward.clone()),
            Some(Forward::Async)
        );
        assert_eq!(spec.handle("cl_mem").map(|h| h.invalid), Some(-38));
    }

    #[test]
    fn unknown_parameter_in_expression_is_an_error() {
        let src = MINI.replace("buffer(param_value_size)", "buffer(nope)");

        assert!(matches!(parse(&src), Err(Error::Semantic { .. })));
    }

    #[test]
    fn undeclared_type_is_an_error() {
        let src = MINI.replace("cl_mem memobj) [async", "cl_sampler memobj) [async");

        assert!(matches!(parse(&src), Err(Error::Semantic { .. })));
    }

    #[test]
    fn the_opencl_spec_parses() {
        let src = include_str!("../../../spec/opencl.spec");

        let spec = parse(src).expect("spec/opencl.spec is valid");

        assert_eq!(spec.dispatch.len(), 149);
    }

    proptest::proptest! {
        #[test]
        fn parser_never_panics(s in "[a-z_ ()\\[\\],;*0-9#=+{}-]{0,80}") {
            let _ = parse(&s);
        }
    }
}
