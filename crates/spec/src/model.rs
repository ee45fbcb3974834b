//! What a spec says: types, functions with their descriptors, info translations and the
//! dispatch-table order.

/// A C type as written: `const char **` is base `char`, two pointers, const.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CType {
    pub base: String,
    pub ptrs: u8,
    pub is_const: bool,
}

impl CType {
    pub fn is_void(&self) -> bool {
        self.base == "void" && self.ptrs == 0
    }
}

/// A size or count expression over the function's parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expr {
    Num(i64),
    Var(String),
    Mul(Box<Expr>, Box<Expr>),
    Add(Box<Expr>, Box<Expr>),
    /// A call of a runtime library helper (image sizes, rectangle extents).
    Call(String, Vec<Expr>),
}

impl Expr {
    /// Parameter names this expression reads.
    pub fn vars(&self, out: &mut Vec<String>) {
        match self {
            Expr::Num(_) => {}
            Expr::Var(v) => out.push(v.clone()),
            Expr::Mul(a, b) | Expr::Add(a, b) => {
                a.vars(out);
                b.vars(out);
            }
            Expr::Call(_, args) => args.iter().for_each(|a| a.vars(out)),
        }
    }
}

/// Kinds of callbacks the runtime knows how to deliver back to the guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallbackKind {
    /// `void (const char *errinfo, const void *private_info, size_t cb, void *user_data)`
    ContextNotify,
    /// `void (cl_program, void *user_data)`
    ProgramNotify,
    /// `void (cl_event, cl_int status, void *user_data)`
    EventNotify,
    /// `void (object, void *user_data)` for memory objects and contexts.
    ObjectNotify,
}

/// How a parameter is marshalled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ParamKind {
    /// Passed by value (a scalar or a handle).
    Value,
    /// Pointer to one value, input.
    InElement,
    /// Pointer to one value, output.
    OutElement,
    /// Pointer to `n` values, input.
    InArray(Expr),
    /// Pointer to `n` values, output.
    OutArray(Expr),
    /// Pointer to `n` raw bytes, input.
    InBuffer(Expr),
    /// Pointer to `n` raw bytes, output; `info` marks info-query results.
    OutBuffer { len: Expr, info: bool },
    /// NUL-terminated string.
    String,
    /// `n` strings or byte buffers; `lengths` names the lengths parameter, if any.
    Strings {
        count: Expr,
        lengths: Option<String>,
    },
    /// Zero-terminated property list; `context` translates CL_CONTEXT_PLATFORM.
    Properties { context: bool },
    /// Host pointer read only when the flags ask for USE/COPY_HOST_PTR.
    HostBuffer { flags: String, len: Expr },
    /// A `cl_image_desc` holding a handle.
    ImageDesc,
    /// A kernel argument value of the given size.
    KernelArg(Expr),
    /// The errcode_ret out parameter.
    Errcode,
    /// A callback function pointer and the parameter that is its user data.
    Callback {
        kind: CallbackKind,
        user_data: String,
    },
    /// User data consumed by a callback.
    UserData,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Param {
    pub name: String,
    pub ty: CType,
    pub kind: ParamKind,
}

/// How a function is forwarded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Forward {
    Sync,
    Async,
    /// Async unless the named boolean parameter is true.
    AsyncUnless(String),
    /// Not forwarded: returns the error.
    Unsupported(String),
    /// Answered in the guest library.
    GuestOnly,
}

/// Which halves are hand-written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Custom {
    None,
    Server,
    Both,
    /// Generated stub, reached through a hand-written guest wrapper.
    Guest,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Function {
    pub name: String,
    pub ret: CType,
    pub params: Vec<Param>,
    pub forward: Forward,
    pub custom: Custom,
    /// The server runs the call blocking although the named parameter may say otherwise.
    pub force_blocking: Option<String>,
    /// Kind of object this call creates (returned, or in an out array/element).
    pub creates: Option<String>,
    pub retains: bool,
    pub releases: bool,
    /// Bytes of device memory this call allocates.
    pub allocates: Option<Expr>,
    /// The call consumes device time (a kernel launch).
    pub device_time: bool,
    /// The call reads or writes buffers on the device: under over-subscription they must be
    /// resident, so the router schedules it like a launch.
    pub resident: bool,
    /// Opcode on the wire (position in the spec, from 1).
    pub opcode: u16,
    pub line: usize,
}

impl Function {
    pub fn returns_handle(&self, spec: &Spec) -> bool {
        self.ret.ptrs == 0 && spec.handle(&self.ret.base).is_some()
    }
    pub fn param(&self, name: &str) -> Option<&Param> {
        self.params.iter().find(|p| p.name == name)
    }
    pub fn is_forwarded(&self) -> bool {
        !matches!(self.forward, Forward::Unsupported(_) | Forward::GuestOnly)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HandleType {
    pub ctype: String,
    pub kind: String,
    pub invalid_name: String,
    pub invalid: i32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScalarType {
    pub ctype: String,
    /// Rust primitive: i8 u8 i32 u32 u64 usize isize.
    pub prim: String,
}

/// How an info result is translated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InfoMode {
    Handle,
    Handles,
    Properties,
    /// Answered by the guest library (host pointers, binaries).
    Guest,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InfoDecl {
    pub function: String,
    pub value: u32,
    pub name: String,
    pub mode: InfoMode,
    pub ctype: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Spec {
    pub handles: Vec<HandleType>,
    pub scalars: Vec<ScalarType>,
    pub infos: Vec<InfoDecl>,
    pub functions: Vec<Function>,
    pub dispatch: Vec<String>,
}

impl Spec {
    pub fn handle(&self, ctype: &str) -> Option<&HandleType> {
        self.handles.iter().find(|h| h.ctype == ctype)
    }
    pub fn handle_kind(&self, kind: &str) -> Option<&HandleType> {
        self.handles.iter().find(|h| h.kind == kind)
    }
    pub fn scalar(&self, ctype: &str) -> Option<&ScalarType> {
        self.scalars.iter().find(|s| s.ctype == ctype)
    }
    pub fn function(&self, name: &str) -> Option<&Function> {
        self.functions.iter().find(|f| f.name == name)
    }
    /// Size in bytes of a value of the given base type (handles are pointers).
    pub fn size_of(&self, base: &str) -> Option<u64> {
        if self.handle(base).is_some() {
            return Some(8);
        }
        self.scalar(base).map(|s| match s.prim.as_str() {
            "i8" | "u8" => 1,
            "i32" | "u32" => 4,
            _ => 8,
        })
    }
}
