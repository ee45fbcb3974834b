//! Code emitters. Each returns Rust source as a string.

use hira_spec::{CType, CallbackKind, Custom, Expr, Forward, Function, InfoMode, ParamKind, Spec};
use std::fmt::Write;

fn op_const(f: &Function) -> String {
    format!("OP_{}", f.name.to_uppercase())
}

/// Rust type of a C type in an FFI signature.
fn rust_ty(spec: &Spec, t: &CType) -> String {
    if t.ptrs == 0 {
        if spec.handle(&t.base).is_some() {
            return "*mut c_void".into();
        }
        if t.base == "void" {
            return "()".into();
        }
        return spec.scalar(&t.base).map_or("u8".into(), |s| s.prim.clone());
    }
    let inner = CType {
        base: t.base.clone(),
        ptrs: t.ptrs - 1,
        is_const: false,
    };
    let inner = if inner.ptrs == 0 && t.base == "void" {
        "c_void".to_string()
    } else {
        rust_ty(spec, &inner)
    };
    if t.is_const && t.ptrs == 1 {
        format!("*const {inner}")
    } else {
        format!("*mut {inner}")
    }
}

fn ret_ty(spec: &Spec, f: &Function) -> String {
    if f.ret.is_void() {
        String::new()
    } else {
        format!(" -> {}", rust_ty(spec, &f.ret))
    }
}

fn signature(spec: &Spec, f: &Function) -> String {
    let params: Vec<String> = f
        .params
        .iter()
        .map(|p| format!("{}: {}", p.name, rust_ty(spec, &p.ty)))
        .collect();
    format!("({}){}", params.join(", "), ret_ty(spec, f))
}

fn fn_ptr_ty(spec: &Spec, f: &Function) -> String {
    let params: Vec<String> = f.params.iter().map(|p| rust_ty(spec, &p.ty)).collect();
    format!(
        "unsafe extern \"C\" fn({}){}",
        params.join(", "),
        ret_ty(spec, f)
    )
}

fn kind_const(kind: &str) -> String {
    format!("K_{}", kind.to_uppercase())
}

/// Element type of a pointer parameter, and its handle kind if it is a handle.
fn elem<'a>(spec: &'a Spec, t: &CType) -> (String, Option<&'a str>) {
    let base = CType {
        base: t.base.clone(),
        ptrs: t.ptrs.saturating_sub(1),
        is_const: false,
    };
    let h = if base.ptrs == 0 {
        spec.handle(&t.base).map(|h| h.kind.as_str())
    } else {
        None
    };
    (rust_ty(spec, &base), h)
}

/// An expression as Rust (u64 arithmetic). `helper` prefixes runtime-library calls.
fn expr(spec: &Spec, f: &Function, e: &Expr, helper: &str) -> String {
    match e {
        Expr::Num(n) => format!("{n}u64"),
        Expr::Var(v) => {
            let p = f.param(v).expect("checked by the spec parser");
            if p.ty.ptrs == 0 && spec.handle(&p.ty.base).is_none() {
                format!("({v} as u64)")
            } else {
                v.clone()
            }
        }
        Expr::Mul(a, b) => format!(
            "{}.saturating_mul({})",
            expr(spec, f, a, helper),
            expr(spec, f, b, helper)
        ),
        Expr::Add(a, b) => format!(
            "{}.saturating_add({})",
            expr(spec, f, a, helper),
            expr(spec, f, b, helper)
        ),
        Expr::Call(name, args) => {
            let a: Vec<String> = args.iter().map(|a| expr(spec, f, a, helper)).collect();
            format!("{helper}{name}({})", a.join(", "))
        }
    }
}

fn cb_kind(k: CallbackKind) -> &'static str {
    match k {
        CallbackKind::ContextNotify => "CallbackKind::ContextNotify",
        CallbackKind::ProgramNotify => "CallbackKind::ProgramNotify",
        CallbackKind::EventNotify => "CallbackKind::EventNotify",
        CallbackKind::ObjectNotify => "CallbackKind::ObjectNotify",
    }
}

fn forward_code(f: &Function) -> &'static str {
    match f.forward {
        Forward::Sync => "Forward::Sync",
        Forward::Async => "Forward::Async",
        Forward::AsyncUnless(_) => "Forward::AsyncUnless",
        Forward::Unsupported(_) => "Forward::Unsupported",
        Forward::GuestOnly => "Forward::GuestOnly",
    }
}

/// Opcodes, handle kinds, the per-opcode table and the router's accounting hooks.
pub fn common(spec: &Spec) -> String {
    let mut s = String::new();
    for (i, h) in spec.handles.iter().enumerate() {
        let _ = writeln!(
            s,
            "/// Handle kind `{}`.\npub const {}: u8 = {};",
            h.ctype,
            kind_const(&h.kind),
            i + 1
        );
    }
    let _ = writeln!(
        s,
        "/// Error returned for a bad handle of each kind (index = kind)."
    );
    let _ = write!(
        s,
        "pub const INVALID_HANDLE: [i32; {}] = [0",
        spec.handles.len() + 1
    );
    for h in &spec.handles {
        let _ = write!(s, ", {}", h.invalid);
    }
    let _ = writeln!(s, "];\n/// Name of each handle kind (index = kind).");
    let _ = write!(
        s,
        "pub const KIND_NAMES: [&str; {}] = [\"none\"",
        spec.handles.len() + 1
    );
    for h in &spec.handles {
        let _ = write!(s, ", \"{}\"", h.kind);
    }
    let _ = writeln!(s, "];");
    for f in &spec.functions {
        let _ = writeln!(s, "pub const {}: u16 = {};", op_const(f), f.opcode);
    }
    let _ = writeln!(
        s,
        "/// Every function of the spec, indexed by opcode - 1.\npub static OPS: [OpInfo; {}] = [",
        spec.functions.len()
    );
    for f in &spec.functions {
        let creates = f.creates.as_deref().map_or("0".to_string(), kind_const);
        let unsupported = match &f.forward {
            Forward::Unsupported(e) => e.clone(),
            _ => "0".into(),
        };
        let _ = writeln!(
            s,
            "    OpInfo {{ name: \"{}\", opcode: {}, forward: {}, device_time: {}, resident: {}, creates: {}, retains: {}, releases: {}, allocates: {}, custom: {}, unsupported: {} }},",
            f.name,
            f.opcode,
            forward_code(f),
            f.device_time,
            f.resident,
            creates,
            f.retains,
            f.releases,
            f.allocates.is_some(),
            f.custom != Custom::None,
            unsupported
        );
    }
    let _ = writeln!(s, "];");
    // Info translations.
    let _ = writeln!(
        s,
        "/// Info results that need translating: (opcode, param value, mode, handle kind)."
    );
    let _ = writeln!(
        s,
        "pub static INFOS: [(u16, u32, InfoMode, u8); {}] = [",
        spec.infos.len()
    );
    for i in &spec.infos {
        let f = spec.function(&i.function).expect("checked by the parser");
        let mode = match i.mode {
            InfoMode::Handle => "InfoMode::Handle",
            InfoMode::Handles => "InfoMode::Handles",
            InfoMode::Properties => "InfoMode::Properties",
            InfoMode::Guest => "InfoMode::Guest",
        };
        let kind = spec
            .handle(&i.ctype)
            .map_or("0".to_string(), |h| kind_const(&h.kind));
        let _ = writeln!(
            s,
            "    ({}, {:#x}, {mode}, {kind}), // {}",
            op_const(f),
            i.value,
            i.name
        );
    }
    let _ = writeln!(s, "];");
    // Router accounting hook: bytes an allocating call asks for, read from its request payload.
    let _ = writeln!(s, "/// Device-memory bytes an allocating request asks for (the spec's `allocates`),\n/// decoded from its payload; None for other opcodes or when it cannot be read.");
    let _ = writeln!(s, "pub fn alloc_request_bytes(opcode: u16, payload: &[u8]) -> Option<u64> {{\n    let mut r = hira_wire::Reader::new(payload);\n    match opcode {{");
    for f in &spec.functions {
        let Some(size) = &f.allocates else {
            continue;
        };
        if !f.is_forwarded() {
            continue;
        }
        // Decode every parameter into a local of its wire form, then evaluate the spec's
        // expression over them (helpers in `cl::wire` read inline blobs).
        let _ = writeln!(s, "        {} => {{", op_const(f));
        for p in &f.params {
            let _ = writeln!(s, "            {}", read_param(spec, p));
        }
        let _ = writeln!(
            s,
            "            Some({})\n        }}",
            wire_expr(spec, f, size)
        );
    }
    let _ = writeln!(s, "        _ => None,\n    }}\n}}");
    // Router residency hook: the buffers a command names, and the kernel it launches.
    let _ = writeln!(s, "/// Memory objects a `resident` request names directly, and the kernel it launches (0 if\n/// none), decoded from its payload; None for other opcodes or when it cannot be read.");
    let _ = writeln!(s, "#[allow(unused_mut, unused_assignments)]\npub fn request_mems(opcode: u16, payload: &[u8]) -> Option<(Vec<u64>, u64)> {{\n    let mut r = hira_wire::Reader::new(payload);\n    match opcode {{");
    for f in &spec.functions {
        if !f.resident || !f.is_forwarded() || f.custom == Custom::Both {
            continue;
        }
        let _ = writeln!(s, "        {} => {{", op_const(f));
        let _ = writeln!(s, "            let mut mems: Vec<u64> = Vec::new();\n            let mut launched = 0u64;");
        for p in &f.params {
            let line = read_param(spec, p);
            if line.is_empty() {
                continue;
            }
            let _ = writeln!(s, "            {line}");
            let n = &p.name;
            let kind = spec.handle(&p.ty.base).map(|h| h.kind.as_str());
            match (&p.kind, kind) {
                (ParamKind::Value, Some("mem")) => {
                    let _ = writeln!(s, "            mems.push({n});");
                }
                (ParamKind::Value, Some("kernel")) => {
                    let _ = writeln!(s, "            launched = {n};");
                }
                (ParamKind::InArray(_), Some("mem")) => {
                    let _ = writeln!(s, "            mems.extend(cl::wire::ids(&{n}));");
                }
                _ => {}
            }
        }
        let _ = writeln!(s, "            Some((mems, launched))\n        }}");
    }
    let _ = writeln!(s, "        _ => None,\n    }}\n}}");
    s
}

/// Code that reads one parameter's encoding from a request payload into a local (router side).
fn read_param(spec: &Spec, p: &hira_spec::Param) -> String {
    let n = &p.name;
    match &p.kind {
        ParamKind::Value if spec.handle(&p.ty.base).is_some() || p.ty.ptrs == 0 => {
            format!("let {n} = r.u64().ok()?;")
        }
        ParamKind::Errcode | ParamKind::UserData => String::new(),
        ParamKind::Callback { .. } => format!("let _{n} = r.u64().ok()?;"),
        ParamKind::OutElement if elem(spec, &p.ty).1.is_some() => {
            format!("let _{n} = r.u64().ok()?;")
        }
        ParamKind::OutElement | ParamKind::OutArray(_) | ParamKind::OutBuffer { .. } => {
            format!("let _{n} = r.out_spec().ok()?;")
        }
        ParamKind::KernelArg(_) | ParamKind::Strings { .. } => "return None;".into(),
        _ => format!("let {n} = r.blob().ok()?;"),
    }
}

/// An allocation-size expression over decoded wire values (router side).
fn wire_expr(spec: &Spec, f: &Function, e: &Expr) -> String {
    match e {
        Expr::Num(n) => format!("{n}u64"),
        Expr::Var(v) => {
            let p = f.param(v).expect("checked by the spec parser");
            if p.ty.ptrs == 0 && spec.handle(&p.ty.base).is_none() {
                v.clone()
            } else {
                format!("cl::wire::inline(&{v})")
            }
        }
        Expr::Mul(a, b) => format!(
            "{}.saturating_mul({})",
            wire_expr(spec, f, a),
            wire_expr(spec, f, b)
        ),
        Expr::Add(a, b) => format!(
            "{}.saturating_add({})",
            wire_expr(spec, f, a),
            wire_expr(spec, f, b)
        ),
        Expr::Call(name, args) => {
            let a: Vec<String> = args.iter().map(|a| wire_expr(spec, f, a)).collect();
            format!("cl::wire::{name}({})?", a.join(", "))
        }
    }
}

// ---------------------------------------------------------------------------------------
// Guest

fn guest_encode(spec: &Spec, f: &Function, out: &mut String) {
    for p in &f.params {
        let n = &p.name;
        let line = match &p.kind {
            ParamKind::Value => match spec.handle(&p.ty.base) {
                Some(_) => format!("c.handle({n});"),
                None => format!("c.u64({n} as u64);"),
            },
            ParamKind::InElement => {
                let (t, _) = elem(spec, &p.ty);
                format!("c.in_bytes({n} as *const u8, std::mem::size_of::<{t}>() as u64);")
            }
            ParamKind::InArray(e) => match elem(spec, &p.ty) {
                (_, Some(_)) => format!("c.in_handles({n} as *const *mut c_void, {});", expr(spec, f, e, "rt::expr::")),
                (t, None) => format!(
                    "c.in_bytes({n} as *const u8, {}.saturating_mul(std::mem::size_of::<{t}>() as u64));",
                    expr(spec, f, e, "rt::expr::")
                ),
            },
            ParamKind::InBuffer(e) => format!("c.in_bytes({n} as *const u8, {});", expr(spec, f, e, "rt::expr::")),
            ParamKind::String => format!("c.string({n} as *const c_char);"),
            ParamKind::Strings { count, lengths } => format!(
                "c.strings({n} as *const *const u8, {}, {});",
                expr(spec, f, count, "rt::expr::"),
                lengths.as_ref().map_or("std::ptr::null()".into(), |l| format!("{l} as *const usize"))
            ),
            ParamKind::Properties { context } => format!("c.properties({n} as *const u64, {context});"),
            ParamKind::HostBuffer { flags, len } => {
                format!("c.host_buffer({n} as *const u8, {flags} as u64, {});", expr(spec, f, len, "rt::expr::"))
            }
            ParamKind::ImageDesc => format!("c.image_desc({n} as *const u8);"),
            ParamKind::KernelArg(e) => format!("c.kernel_arg({n} as *const u8, {});", expr(spec, f, e, "rt::expr::")),
            ParamKind::Errcode | ParamKind::UserData => continue,
            ParamKind::Callback { kind, user_data } => {
                format!("c.callback({}, {n} as *mut c_void, {user_data} as *mut c_void);", cb_kind(*kind))
            }
            ParamKind::OutElement => match elem(spec, &p.ty) {
                (_, Some(k)) => format!("c.new_handle({n} as *mut *mut c_void, {});", kind_const(k)),
                (t, None) => format!("c.out_bytes({n} as *mut u8, std::mem::size_of::<{t}>() as u64);"),
            },
            ParamKind::OutArray(e) => {
                let (t, _) = elem(spec, &p.ty);
                format!(
                    "c.out_bytes({n} as *mut u8, {}.saturating_mul(std::mem::size_of::<{t}>() as u64));",
                    expr(spec, f, e, "rt::expr::")
                )
            }
            ParamKind::OutBuffer { len, info: true } => format!(
                "c.out_info({} as u32, {n} as *mut u8, {});",
                f.params.iter().find(|p| p.name == "param_name").map_or("0", |p| p.name.as_str()),
                expr(spec, f, len, "rt::expr::")
            ),
            ParamKind::OutBuffer { len, .. } => format!("c.out_bytes({n} as *mut u8, {});", expr(spec, f, len, "rt::expr::")),
        };
        let _ = writeln!(out, "        {line}");
    }
}

fn guest_decode(spec: &Spec, f: &Function, out: &mut String) {
    let param_name = f
        .params
        .iter()
        .find(|p| p.name == "param_name")
        .map(|p| p.name.clone());
    for p in &f.params {
        let n = &p.name;
        let line = match &p.kind {
            ParamKind::OutElement if elem(spec, &p.ty).1.is_some() => continue,
            ParamKind::OutElement => format!("r.out_bytes({n} as *mut u8)?;"),
            ParamKind::OutArray(_) => match elem(spec, &p.ty) {
                (_, Some(k)) => format!(
                    "r.out_handles({n} as *mut *mut c_void, {})?;",
                    kind_const(k)
                ),
                (_, None) => format!("r.out_bytes({n} as *mut u8)?;"),
            },
            ParamKind::OutBuffer { info: true, .. } => {
                let mut line = format!(
                    "let written = r.out_bytes({n} as *mut u8)?;\n        r.info({}, {} as u32, {} as *mut c_void, {n} as *mut u8, written);",
                    op_const(f),
                    param_name.as_deref().unwrap_or("0"),
                    f.params[0].name
                );
                if let Some(obj) = plain_info(f) {
                    let _ = write!(
                        line,
                        "\n        if ret == 0 {{ crate::infocache::remember({}, rt::id_of({obj} as *mut c_void), param_name as u32, {n} as *const u8, written); }}",
                        op_const(f)
                    );
                }
                line
            }
            ParamKind::OutBuffer { .. } => format!("r.out_bytes({n} as *mut u8)?;"),
            _ => continue,
        };
        let _ = writeln!(out, "        {line}");
    }
}

/// An info query of the plain shape `(object, param_name, param_value_size, param_value,
/// param_value_size_ret)`: the object's parameter name. The guest keeps the answers that
/// cannot change (`crates/guest/src/infocache.rs` says which).
fn plain_info(f: &Function) -> Option<&str> {
    let names: Vec<&str> = f.params.iter().map(|p| p.name.as_str()).collect();
    let info = f
        .params
        .iter()
        .any(|p| matches!(p.kind, ParamKind::OutBuffer { info: true, .. }));
    (info
        && names.len() == 5
        && names[1..]
            == [
                "param_name",
                "param_value_size",
                "param_value",
                "param_value_size_ret",
            ])
    .then_some(names[0])
}

fn errcode_param(f: &Function) -> Option<&str> {
    f.params
        .iter()
        .find(|p| p.kind == ParamKind::Errcode || (p.name == "errcode_ret" && p.ty.ptrs == 1))
        .map(|p| p.name.as_str())
}

fn guest_stub(spec: &Spec, f: &Function) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "/// `{}`: {:?} (generated from the spec).\n///\n/// # Safety\n/// The caller passes arguments valid for the OpenCL C API.", f.name, f.forward);
    let _ = writeln!(
        s,
        "pub unsafe extern \"C\" fn {}{} {{",
        f.name,
        signature(spec, f)
    );
    if let Forward::Unsupported(e) = &f.forward {
        let errcode = errcode_param(f);
        let _ = writeln!(s, "    rt::unsupported(\"{}\");", f.name);
        if f.ret.ptrs > 0 || spec.handle(&f.ret.base).is_some() {
            if let Some(ec) = errcode {
                let _ = writeln!(s, "    // SAFETY: a non-null errcode_ret points to a cl_int (API contract).\n    if !{ec}.is_null() {{ unsafe {{ *{ec} = {e}; }} }}");
            }
            let _ = writeln!(s, "    std::ptr::null_mut()\n}}");
        } else if f.ret.is_void() {
            let _ = writeln!(s, "}}");
        } else {
            let _ = writeln!(s, "    {e}\n}}");
        }
        return s;
    }
    let creates_ret = f.returns_handle(spec);
    if creates_ret {
        let ec = errcode_param(f).map_or("std::ptr::null_mut()".to_string(), str::to_string);
        let _ = writeln!(s, "    rt::create({ec}, {}, || {{", op_const(f));
    } else {
        let _ = writeln!(s, "    rt::status({}, || {{", op_const(f));
    }
    if let Some(obj) = plain_info(f) {
        let _ = writeln!(
            s,
            "        // SAFETY: the application's output pointers (API contract).\n        if let Some(ret) = unsafe {{ crate::infocache::lookup({op}, rt::id_of({obj} as *mut c_void), param_name as u32, param_value as *mut u8, param_value_size as usize, param_value_size_ret as *mut usize) }} {{ return Ok(ret); }}",
            op = op_const(f)
        );
    }
    let _ = writeln!(s, "        let mut c = rt::Call::new({});", op_const(f));
    let _ = writeln!(s, "        // SAFETY: pointers come from the application under the API's contract.\n        unsafe {{");
    let mut enc = String::new();
    guest_encode(spec, f, &mut enc);
    s.push_str(&enc);
    let _ = writeln!(s, "        }}");
    match &f.forward {
        Forward::Async => {
            let _ = writeln!(s, "        return c.send_async();");
        }
        Forward::AsyncUnless(p) => {
            let _ = writeln!(s, "        if {p} == 0 {{ return c.send_async(); }}");
        }
        _ => {}
    }
    if !matches!(f.forward, Forward::Async) {
        let _ = writeln!(
            s,
            "        #[allow(unreachable_code)]\n        let mut r = c.sync()?;"
        );
        if creates_ret {
            let kind = kind_const(
                f.creates
                    .as_deref()
                    .expect("a creating function names its kind"),
            );
            let _ = writeln!(s, "        let err = r.i32()?;\n        let id = r.u64()?;");
            let mut dec = String::new();
            guest_decode(spec, f, &mut dec);
            let _ = writeln!(s, "        // SAFETY: output pointers come from the application.\n        unsafe {{\n{dec}        }}");
            let _ = writeln!(s, "        Ok((r.created(id, {kind}), err))");
        } else {
            let _ = writeln!(s, "        let ret = r.i32()?;");
            let mut dec = String::new();
            guest_decode(spec, f, &mut dec);
            let _ = writeln!(s, "        // SAFETY: output pointers come from the application.\n        unsafe {{\n{dec}        }}");
            let _ = writeln!(s, "        r.status(ret)");
        }
    }
    let _ = writeln!(s, "    }})\n}}");
    s
}

/// Guest stubs, the ICD dispatch table and the extension-function lookup table.
pub fn guest(spec: &Spec) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "#[allow(non_snake_case, unused_mut, unused_unsafe, unused_variables, unused_parens, unreachable_code, clippy::all, clippy::undocumented_unsafe_blocks)]\npub mod stubs {{\nuse super::*;");
    for f in &spec.functions {
        if f.custom == Custom::Both
            || matches!(f.forward, Forward::GuestOnly)
            || f.name.starts_with("hira")
        {
            continue;
        }
        s.push_str(&guest_stub(spec, f));
    }
    let _ = writeln!(s, "}}");
    // hira's own functions used by hand-written guest code.
    for f in spec.functions.iter().filter(|f| f.name.starts_with("hira")) {
        let _ = writeln!(s, "#[allow(non_snake_case, unused_mut, unused_unsafe, unused_variables, unused_parens, unreachable_code, clippy::all, clippy::undocumented_unsafe_blocks)]\n{}", guest_stub(spec, f));
    }
    let where_is = |name: &str| -> String {
        let f = spec.function(name).expect("checked by the parser");
        if matches!(f.custom, Custom::Both | Custom::Guest)
            || matches!(f.forward, Forward::GuestOnly)
        {
            format!("custom::{name}")
        } else {
            format!("stubs::{name}")
        }
    };
    let _ = writeln!(
        s,
        "/// The ICD dispatch table, in `cl_icd.h` order.\n#[repr(C)]\npub struct IcdDispatch {{"
    );
    for name in &spec.dispatch {
        let f = spec.function(name).expect("checked by the parser");
        let _ = writeln!(s, "    pub {name}: {},", fn_ptr_ty(spec, f));
    }
    let _ = writeln!(s, "}}\n/// The one dispatch table every hira object points to.\npub static DISPATCH: IcdDispatch = IcdDispatch {{");
    for name in &spec.dispatch {
        let _ = writeln!(s, "    {name}: {},", where_is(name));
    }
    let _ = writeln!(s, "}};");
    let _ = writeln!(s, "/// Address of an API function by name (for clGetExtensionFunctionAddress).\npub fn function_address(name: &str) -> Option<*mut c_void> {{\n    Some(match name {{");
    for name in &spec.dispatch {
        let _ = writeln!(
            s,
            "        \"{name}\" => {} as *mut c_void,",
            where_is(name)
        );
    }
    let _ = writeln!(s, "        _ => return None,\n    }})\n}}");
    s
}

// ---------------------------------------------------------------------------------------
// Server

fn server_handler(spec: &Spec, f: &Function) -> String {
    let mut s = String::new();
    let mut p1 = String::new(); // read the wire
    let mut p2 = String::new(); // materialize
    let mut post = String::new(); // after the call
    let mut emit = String::new(); // reply outputs
    let mut args = Vec::new();
    let param_name = f
        .params
        .iter()
        .find(|p| p.name == "param_name")
        .map(|p| p.name.clone());
    let event_param = f
        .params
        .iter()
        .find(|p| p.kind == ParamKind::OutElement && elem(spec, &p.ty).1 == Some("event"));
    for p in &f.params {
        let n = &p.name;
        let (ety, ekind) = elem(spec, &p.ty);
        let ex = |e: &Expr| expr(spec, f, e, "expr::");
        match &p.kind {
            ParamKind::Value => match spec.handle(&p.ty.base) {
                Some(h) => {
                    let _ = writeln!(p1, "    let {n}_id = r.u64()?;");
                    let _ = writeln!(
                        p2,
                        "    let {n} = cx.handle({n}_id, {})?;",
                        kind_const(&h.kind)
                    );
                    args.push(n.clone());
                }
                None => {
                    let _ = writeln!(p1, "    let {n} = r.u64()? as {};", rust_ty(spec, &p.ty));
                    args.push(n.clone());
                }
            },
            ParamKind::InElement => {
                let _ = writeln!(p1, "    let {n}_b = r.blob()?;");
                let _ = writeln!(p2, "    let {n}_v = cx.in_array::<{ety}>({n}_b, 1)?;");
                let _ = writeln!(p2, "    let {n} = {n}_v.ptr();");
                args.push(format!("{n}_v.ptr()"));
            }
            ParamKind::InArray(e) => {
                let _ = writeln!(p1, "    let {n}_b = r.blob()?;");
                match ekind {
                    Some(k) => {
                        let _ = writeln!(
                            p2,
                            "    let {n}_v = cx.in_handles({n}_b, {}, {})?;",
                            ex(e),
                            kind_const(k)
                        );
                    }
                    None => {
                        let _ = writeln!(
                            p2,
                            "    let {n}_v = cx.in_array::<{ety}>({n}_b, {})?;",
                            ex(e)
                        );
                    }
                }
                let _ = writeln!(p2, "    let {n} = {n}_v.ptr();");
                args.push(format!("{n} as _"));
            }
            ParamKind::InBuffer(e) => {
                let _ = writeln!(p1, "    let {n}_b = r.blob()?;");
                match &f.forward {
                    // A non-blocking write reads host memory after the call returns: stage it.
                    Forward::AsyncUnless(b) => {
                        let _ = writeln!(
                            p2,
                            "    let {n}_v = cx.in_bytes_staged({n}_b, {}, {b} == 0)?;",
                            ex(e)
                        );
                    }
                    _ => {
                        let _ = writeln!(p2, "    let {n}_v = cx.in_bytes({n}_b, {})?;", ex(e));
                    }
                }
                let _ = writeln!(p2, "    let {n} = {n}_v.ptr();");
                args.push(format!("{n}_v.ptr() as _"));
            }
            ParamKind::HostBuffer { flags, len } => {
                let _ = writeln!(p1, "    let {n}_b = r.blob()?;");
                let _ = writeln!(
                    p2,
                    "    let {n}_v = cx.in_host_buffer({n}_b, {flags} as u64, {})?;",
                    ex(len)
                );
                let _ = writeln!(
                    p2,
                    "    let {flags} = Ctx::host_ptr_flags({flags} as u64) as _;"
                );
                args.push(format!("{n}_v.ptr() as _"));
            }
            ParamKind::String => {
                let _ = writeln!(p1, "    let {n}_b = r.blob()?;");
                let _ = writeln!(p2, "    let {n}_v = cx.in_string({n}_b)?;");
                args.push(format!("{n}_v.ptr() as _"));
            }
            ParamKind::Strings { count, .. } => {
                let _ = writeln!(p1, "    let {n}_s = cx.read_strings(r)?;");
                let _ = writeln!(p2, "    let {n}_v = cx.in_strings({n}_s, {})?;", ex(count));
                args.push(format!("{n}_v.ptr() as _"));
            }
            ParamKind::Properties { context } => {
                let _ = writeln!(p1, "    let {n}_b = r.blob()?;");
                let _ = writeln!(p2, "    let {n}_v = cx.in_properties({n}_b, {context})?;");
                args.push(format!("{n}_v.ptr() as _"));
            }
            ParamKind::ImageDesc => {
                let _ = writeln!(p1, "    let {n}_b = r.blob()?;");
                let _ = writeln!(p2, "    let {n}_v = cx.in_image_desc({n}_b)?;");
                let _ = writeln!(p2, "    let {n} = {n}_v.ptr();");
                args.push(format!("{n}_v.ptr() as _"));
            }
            ParamKind::KernelArg(e) => {
                let _ = writeln!(p1, "    let {n}_k = cx.read_kernel_arg(r)?;");
                let _ = writeln!(p2, "    let {n}_v = cx.in_kernel_arg({n}_k, {})?;", ex(e));
                args.push(format!("{n}_v.ptr() as _"));
            }
            ParamKind::Errcode => {
                let _ = writeln!(p2, "    let mut {n}_v: i32 = 0;");
                args.push(format!("&mut {n}_v"));
            }
            ParamKind::Callback { kind, user_data } => {
                let _ = writeln!(p1, "    let {n}_id = r.u64()?;");
                let _ = writeln!(
                    p2,
                    "    let ({n}, {user_data}) = cx.callback({}, {n}_id);",
                    cb_kind(*kind)
                );
                args.push(format!("{n} as _"));
            }
            ParamKind::UserData => args.push(format!("{n} as _")),
            ParamKind::OutElement if ekind.is_some() => {
                let k = kind_const(ekind.expect("checked"));
                let _ = writeln!(p1, "    let {n}_id = r.u64()?;");
                // Should the request fail, the event is known never to come.
                let _ = writeln!(p1, "    cx.named_event = {n}_id;");
                let _ = writeln!(
                    p2,
                    "    let mut {n}_new: *mut c_void = std::ptr::null_mut();"
                );
                if f.device_time || f.resident || matches!(f.forward, Forward::AsyncUnless(_)) {
                    let _ = writeln!(
                        p2,
                        "    let mut {n}_dt: *mut c_void = std::ptr::null_mut();"
                    );
                    let device_time = if f.device_time {
                        "true"
                    } else if f.resident {
                        // Completions of buffer commands matter only while the router
                        // schedules them (over-subscription).
                        "cx.gated()"
                    } else {
                        "false"
                    };
                    // The server asks for an event of its own only when it has a use for
                    // one (device time, or staged inputs to free on completion): a
                    // completion callback costs the vendor a thread wake-up per command.
                    let _ = writeln!(
                        p2,
                        "    let {n}_want = {n}_id == 0 && cx.wants_event({device_time});"
                    );
                    args.push(format!(
                        "if {n}_id != 0 {{ &mut {n}_new }} else if {n}_want {{ &mut {n}_dt }} else {{ std::ptr::null_mut() }}"
                    ));
                    // A launch's event the guest named is posted on the event board.
                    let board = if f.device_time {
                        format!("{n}_id")
                    } else {
                        "0".to_string()
                    };
                    let _ = writeln!(
                        post,
                        "    cx.track_event(ret, if {n}_id != 0 {{ {n}_new }} else {{ {n}_dt }}, {n}_id == 0, {device_time}, {board});"
                    );
                } else {
                    args.push(format!(
                        "if {n}_id != 0 {{ &mut {n}_new }} else {{ std::ptr::null_mut() }}"
                    ));
                }
                let _ = writeln!(post, "    if {n}_id != 0 && !{n}_new.is_null() {{ cx.bind({n}_id, {n}_new, {k})?; }}");
            }
            ParamKind::OutElement => {
                let _ = writeln!(p1, "    let {n}_o = r.out_spec()?;");
                let _ = writeln!(
                    p2,
                    "    let mut {n}_v = cx.out({n}_o, std::mem::size_of::<{ety}>() as u64)?;"
                );
                args.push(format!("{n}_v.ptr() as _"));
                let _ = writeln!(emit, "    {n}_v.emit(&mut w);");
            }
            ParamKind::OutArray(e) => {
                let _ = writeln!(p1, "    let {n}_o = r.out_spec()?;");
                let _ = writeln!(
                    p2,
                    "    let mut {n}_v = cx.out({n}_o, {}.saturating_mul(std::mem::size_of::<{ety}>() as u64))?;",
                    ex(e)
                );
                args.push(format!("{n}_v.ptr() as _"));
                if let Some(k) = ekind {
                    let _ = writeln!(
                        post,
                        "    cx.out_handles_to_ids(&mut {n}_v, {}, ret)?;",
                        kind_const(k)
                    );
                }
                let _ = writeln!(emit, "    {n}_v.emit(&mut w);");
            }
            ParamKind::OutBuffer { len, info } => {
                let _ = writeln!(p1, "    let {n}_o = r.out_spec()?;");
                let _ = writeln!(p2, "    let mut {n}_v = cx.out({n}_o, {})?;", ex(len));
                if *info {
                    args.push(format!(
                        "cx.info_ptr({}, {} as u32, &mut {n}_v) as _",
                        op_const(f),
                        param_name.as_deref().unwrap_or("0")
                    ));
                } else {
                    args.push(format!("{n}_v.ptr() as _"));
                }
                if *info {
                    let _ = writeln!(
                        post,
                        "    cx.info_out({}, {} as u32, &mut {n}_v, ret)?;",
                        op_const(f),
                        param_name.as_deref().unwrap_or("0")
                    );
                }
                let _ = writeln!(emit, "    {n}_v.emit(&mut w);");
            }
        }
    }
    if f.device_time && event_param.is_none() {
        panic!("{}: device_time needs an event out parameter", f.name);
    }
    let _ = writeln!(
        s,
        "/// Server half of `{}` (generated from the spec).",
        f.name
    );
    let _ = writeln!(
        s,
        "pub fn h_{}(cx: &mut Ctx, r: &mut Reader<'_>) -> Result<Writer, Fail> {{",
        f.name
    );
    s.push_str(&p1);
    let _ = writeln!(s, "    r.finish()?;");
    s.push_str(&p2);
    if f.resident {
        // A launch's buffer arguments may have been evicted since they were set: restore
        // them and bind the kernel to their current device objects.
        if let Some(k) = f.params.iter().find(|p| {
            p.kind == ParamKind::Value
                && spec.handle(&p.ty.base).is_some_and(|h| h.kind == "kernel")
        }) {
            let _ = writeln!(s, "    cx.prepare_kernel({}_id)?;", k.name);
        }
    }
    if let Some(b) = &f.force_blocking {
        let _ = writeln!(s, "    let {b}: u32 = 1;");
    }
    let _ = writeln!(
        s,
        "    let f = cx.api.{}.ok_or(Fail::Cl(CL_INVALID_OPERATION))?;",
        f.name
    );
    let _ = writeln!(s, "    // SAFETY: every pointer argument was built above from validated wire data with the\n    // length the spec gives, or is null; handles come from this tenant's table.");
    let creates_ret = f.returns_handle(spec);
    let _ = writeln!(s, "    let ret = unsafe {{ f({}) }};", args.join(", "));
    let mut w = String::from("    let mut w = Writer::default();\n");
    if creates_ret {
        let kind = kind_const(
            f.creates
                .as_deref()
                .expect("a creating function names its kind"),
        );
        let ec = errcode_param(f).expect("a creating function has errcode_ret");
        let _ = writeln!(s, "    let id = cx.register(ret, {kind});");
        let _ = writeln!(w, "    w.i32({ec}_v);\n    w.u64(id);");
        let _ = writeln!(s, "    let ret = {ec}_v;");
    } else {
        let _ = writeln!(w, "    w.i32(ret);");
    }
    s.push_str(&post);
    if f.retains {
        let _ = writeln!(
            s,
            "    if ret == 0 {{ cx.retained({}_id); }}",
            f.params[0].name
        );
    }
    if f.releases {
        let _ = writeln!(
            s,
            "    if ret == 0 {{ cx.released({}_id); }}",
            f.params[0].name
        );
    }
    s.push_str(&w);
    s.push_str(&emit);
    let _ = writeln!(s, "    Ok(w)\n}}");
    s
}

/// The vendor function table (loaded with dlopen) and the server's dispatch.
pub fn server(spec: &Spec) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "/// The vendor's OpenCL entry points, resolved at run time; a missing one is None.\n#[allow(non_snake_case)]\npub struct Api {{");
    for f in spec
        .functions
        .iter()
        .filter(|f| !f.name.starts_with("hira"))
    {
        let _ = writeln!(s, "    pub {}: Option<{}>,", f.name, fn_ptr_ty(spec, f));
    }
    let _ = writeln!(s, "}}\nimpl Api {{\n    /// Resolve every entry point of the spec in `lib`.\n    pub fn load(lib: &libloading::Library) -> Api {{\n        Api {{");
    for f in spec
        .functions
        .iter()
        .filter(|f| !f.name.starts_with("hira"))
    {
        let _ = writeln!(
            s,
            "            // SAFETY: the symbol's type is the spec's prototype of this function.\n            {0}: unsafe {{ lib.get::<{1}>(b\"{0}\\0\").ok().map(|s| *s) }},",
            f.name,
            fn_ptr_ty(spec, f)
        );
    }
    let _ = writeln!(s, "        }}\n    }}\n}}");
    let _ = writeln!(s, "#[allow(non_snake_case, unused_mut, unused_variables, unused_parens, clippy::all)]\npub mod handlers {{\nuse super::*;");
    for f in &spec.functions {
        if !f.is_forwarded() || !matches!(f.custom, Custom::None | Custom::Guest) {
            continue;
        }
        s.push_str(&server_handler(spec, f));
    }
    let _ = writeln!(s, "}}");
    let _ = writeln!(s, "/// Run one request: generated handlers first, hand-written ones for `custom` functions.\npub fn dispatch(cx: &mut Ctx, opcode: u16, r: &mut Reader<'_>) -> Result<Writer, Fail> {{\n    match opcode {{");
    for f in &spec.functions {
        if !f.is_forwarded() {
            continue;
        }
        let target = if matches!(f.custom, Custom::None | Custom::Guest) {
            format!("handlers::h_{}", f.name)
        } else {
            format!("custom::h_{}", f.name)
        };
        let _ = writeln!(s, "        {} => {target}(cx, r),", op_const(f));
    }
    let _ = writeln!(
        s,
        "        _ => Err(Fail::Cl(CL_INVALID_OPERATION)),\n    }}\n}}"
    );
    s
}
