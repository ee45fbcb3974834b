//! `hira bench`: remoting overhead (native against hira), `hira bench fairness` and
//! `hira bench memory`.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use hira_bench::fair::FairOpts;

/// `hira bench [--quick] [--rounds N]` or `hira bench fairness ...`.
pub fn bench(args: Vec<String>) -> Result<u8> {
    if args.first().map(String::as_str) == Some("fairness") {
        return fairness(args[1..].to_vec());
    }
    if args.first().map(String::as_str) == Some("memory") {
        return memory(args[1..].to_vec());
    }
    let mut quick = false;
    let mut rounds = 3usize;
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        if a == "--quick" {
            quick = true;
        } else if let Some(v) = crate::take_value(&a, "--rounds", &mut it)? {
            rounds = v.parse().context("--rounds")?;
        } else {
            bail!("unknown argument {a:?} for bench");
        }
    }
    if rounds == 0 {
        bail!("--rounds must be positive");
    }
    let exe = std::env::current_exe().context("cannot locate the hira executable")?;
    let worker = |under_hira: bool| -> Result<Vec<hira_bench::Row>> {
        let mut cmd = Command::new(&exe);
        if under_hira {
            cmd.arg("run").arg("--").arg(&exe);
        } else {
            cmd.env_remove("OCL_ICD_VENDORS").env_remove("HIRA_SOCKET");
        }
        cmd.arg("bench-worker");
        if quick {
            cmd.arg("--quick");
        }
        let out = cmd
            .stderr(Stdio::inherit())
            .output()
            .context("running bench-worker")?;
        if !out.status.success() {
            bail!("bench-worker failed ({})", out.status);
        }
        Ok(hira_bench::decode(&String::from_utf8_lossy(&out.stdout)))
    };
    let (mut native, mut hira) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        if rounds > 1 {
            eprintln!("round {} of {rounds} ...", round + 1);
        }
        // Alternate which goes first, so neither always runs on a warmer or quieter machine.
        if round % 2 == 0 {
            native.push(worker(false)?);
            hira.push(worker(true)?);
        } else {
            hira.push(worker(true)?);
            native.push(worker(false)?);
        }
    }
    if rounds == 1 {
        print!("{}", hira_bench::table(&native[0], &hira[0]));
    } else {
        print!("{}", hira_bench::table_rounds(&native, &hira));
        println!("(medians of {rounds} rounds; ratio 1.0 = no overhead)");
    }
    Ok(0)
}

/// `hira bench-worker [--quick]`: the workload on whatever OpenCL the loader finds.
pub fn worker(args: Vec<String>) -> Result<u8> {
    let quick = args.iter().any(|a| a == "--quick");
    print!("{}", hira_bench::encode(&hira_bench::worker(quick)?));
    Ok(0)
}

/// `hira bench-tenant --iters N [--depth D] [--seconds S]`: one fairness tenant;
/// `hira bench-tenant --spin`: a kernel that never ends (the runaway test).
pub fn tenant(args: Vec<String>) -> Result<u8> {
    let mut it = args.into_iter();
    let (mut iters, mut depth, mut seconds) = (1000u32, 3usize, 10f64);
    while let Some(arg) = it.next() {
        if let Some(v) = crate::take_value(&arg, "--iters", &mut it)? {
            iters = v.parse().context("--iters")?;
        } else if let Some(v) = crate::take_value(&arg, "--depth", &mut it)? {
            depth = v.parse().context("--depth")?;
        } else if let Some(v) = crate::take_value(&arg, "--seconds", &mut it)? {
            seconds = v.parse().context("--seconds")?;
        } else if arg == "--spin" {
            hira_bench::fair::spin()?;
            bail!("the endless kernel ended");
        } else {
            bail!("unknown argument {arg:?} for bench-tenant");
        }
    }
    let done = hira_bench::fair::tenant(iters, depth, seconds)?;
    println!("kernels {done}");
    Ok(0)
}

const POLICIES: [&str; 9] = [
    "fifo",
    "rr",
    "credit",
    "band",
    "accc",
    "slaf",
    "wfq",
    "wfq-fixed",
    "wfq-aimd",
];

fn fairness(args: Vec<String>) -> Result<u8> {
    let exe = std::env::current_exe().context("cannot locate the hira executable")?;
    let mut o = FairOpts {
        policies: vec!["wfq".into()],
        tenants: 2,
        seconds: 10.0,
        png: None,
        weights: None,
        live: false,
        depth: 3,
        rounds: 1,
        icd: crate::run::find_icd()?,
        exe,
    };
    let mut it = args.into_iter();
    let mut policy_given = false;
    while let Some(arg) = it.next() {
        if let Some(v) = crate::take_value(&arg, "--policy", &mut it)? {
            policy_given = true;
            o.policies = if v == "all" {
                POLICIES.iter().map(|s| s.to_string()).collect()
            } else {
                v.split(',').map(str::to_string).collect()
            };
        } else if let Some(v) = crate::take_value(&arg, "--tenants", &mut it)? {
            o.tenants = v.parse().context("--tenants")?;
        } else if let Some(v) = crate::take_value(&arg, "--seconds", &mut it)? {
            o.seconds = v.parse().context("--seconds")?;
        } else if let Some(v) = crate::take_value(&arg, "--png", &mut it)? {
            o.png = Some(PathBuf::from(v));
        } else if let Some(v) = crate::take_value(&arg, "--depth", &mut it)? {
            o.depth = v.parse().context("--depth")?;
        } else if let Some(v) = crate::take_value(&arg, "--weights", &mut it)? {
            let w: Result<Vec<u32>, _> = v.split(',').map(str::parse).collect();
            o.weights = Some(w.context("--weights: numbers separated by commas")?);
        } else if let Some(v) = crate::take_value(&arg, "--rounds", &mut it)? {
            o.rounds = v.parse().context("--rounds")?;
        } else if arg == "--live" {
            o.live = true;
        } else {
            bail!("unknown argument {arg:?} for bench fairness");
        }
    }
    if !policy_given && o.weights.is_none() && o.tenants == 1 {
        o.policies = vec!["fifo".into()];
    }
    for p in &o.policies {
        if !POLICIES.contains(&p.as_str()) {
            bail!("unknown policy {p:?} ({})", POLICIES.join(", "));
        }
    }
    if o.tenants == 0 || o.seconds <= 0.0 || o.rounds == 0 {
        bail!("--tenants, --seconds and --rounds must be positive");
    }
    print!("{}", hira_bench::fair::fairness(&o)?);
    Ok(0)
}

/// `hira bench-mem-tenant --buffers N --size BYTES [--rounds R] [--seconds S] [--seed X]
/// [--utilization U] [--kernel-us K]`: the memory benchmark's tenant; its exit status is
/// 0 (checksums ok), 1 (mismatch), 2 (an OpenCL call failed) or 64 (bad arguments).
pub fn mem_tenant(args: Vec<String>) -> u8 {
    hira_bench::mem::tenant_main(&args)
}

/// `hira bench memory [--mix set1..set5|all] [--seconds S] [--placement lls,size,util|all]
/// [--tenants N] [--no-control] [--kernel-ms MS] [--sched P] [--unit-kib K]
/// [--idle-after D] [--replace-every D] [--demand DEVICES|none]`; exits 1 when a tenant
/// failed or the control run swapped.
fn memory(args: Vec<String>) -> Result<u8> {
    use hira_bench::mem::{
        mix_by_name, MemOpts, DEFAULT_UNIT, IDLE_AFTER_MS, REPLACE_EVERY_MS, TABLE2_TENANTS,
    };
    let exe = std::env::current_exe().context("cannot locate the hira executable")?;
    // hira run finds the ICD next to the executable: fail early and clearly if it cannot.
    crate::run::find_icd()?;
    let mut o = MemOpts {
        mixes: vec![mix_by_name("set4").expect("Table 2 has set4")],
        seconds: 20.0,
        placements: vec!["lls".parse()?, "size".parse()?, "util".parse()?],
        tenants: TABLE2_TENANTS,
        control: true,
        kernel_ms: 4.0,
        demand: Some(0.6),
        sched: "rr".into(),
        unit: DEFAULT_UNIT,
        monitor: hira_bench::mem::monitor_ms(IDLE_AFTER_MS, REPLACE_EVERY_MS),
        exe,
    };
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        if let Some(v) = crate::take_value(&arg, "--mix", &mut it)? {
            o.mixes = if v == "all" {
                (1..=5)
                    .map(|i| mix_by_name(&format!("set{i}")).expect("Table 2 has five sets"))
                    .collect()
            } else {
                v.split(',')
                    .map(|m| {
                        mix_by_name(m)
                            .with_context(|| format!("unknown mix {m:?} (set1..set5, all)"))
                    })
                    .collect::<Result<_>>()?
            };
        } else if let Some(v) = crate::take_value(&arg, "--placement", &mut it)? {
            let names = if v == "all" {
                "lls,size,util".to_string()
            } else {
                v
            };
            o.placements = names
                .split(',')
                .map(|p| {
                    p.parse().map_err(|_| {
                        anyhow::anyhow!("unknown placement {p:?} (lls, size, util, all)")
                    })
                })
                .collect::<Result<_>>()?;
        } else if let Some(v) = crate::take_value(&arg, "--seconds", &mut it)? {
            o.seconds = v.parse().context("--seconds")?;
        } else if let Some(v) = crate::take_value(&arg, "--tenants", &mut it)? {
            o.tenants = v.parse().context("--tenants")?;
        } else if let Some(v) = crate::take_value(&arg, "--kernel-ms", &mut it)? {
            o.kernel_ms = v.parse().context("--kernel-ms")?;
        } else if let Some(v) = crate::take_value(&arg, "--sched", &mut it)? {
            if !POLICIES.contains(&v.as_str()) {
                bail!("unknown policy {v:?} ({})", POLICIES.join(", "));
            }
            o.sched = v;
        } else if let Some(v) = crate::take_value(&arg, "--unit-kib", &mut it)? {
            let k: u64 = v.parse().context("--unit-kib")?;
            o.unit = k << 10;
        } else if let Some(v) = crate::take_value(&arg, "--idle-after", &mut it)? {
            let d =
                hira_router::parse_duration(&v).with_context(|| format!("bad duration {v:?}"))?;
            o.monitor.idle_threshold = d.as_nanos() as u64;
        } else if let Some(v) = crate::take_value(&arg, "--replace-every", &mut it)? {
            let d =
                hira_router::parse_duration(&v).with_context(|| format!("bad duration {v:?}"))?;
            o.monitor.period = d.as_nanos() as u64;
        } else if let Some(v) = crate::take_value(&arg, "--demand", &mut it)? {
            o.demand = if v == "none" {
                None
            } else {
                let d: f64 = v
                    .parse()
                    .context("--demand: a number of devices, or none")?;
                if !(d > 0.0 && d.is_finite()) {
                    bail!("--demand must be positive");
                }
                Some(d)
            };
        } else if arg == "--no-control" {
            o.control = false;
        } else {
            bail!("unknown argument {arg:?} for bench memory");
        }
    }
    if o.tenants == 0 || o.tenants > TABLE2_TENANTS {
        bail!("--tenants must be between 1 and {TABLE2_TENANTS}");
    }
    if !(o.seconds > 0.0 && o.kernel_ms > 0.0 && o.unit >= 1024) {
        bail!("--seconds, --kernel-ms and --unit-kib must be positive");
    }
    if o.monitor.idle_threshold == 0 || o.monitor.period == 0 {
        bail!("--idle-after and --replace-every must be positive");
    }
    let (report, ok) = hira_bench::mem::memory(&o)?;
    print!("{report}");
    Ok(if ok { 0 } else { 1 })
}
