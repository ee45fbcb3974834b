//! `hira bench`: remoting overhead (native against hira), and `hira bench fairness`.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use hira_bench::fair::FairOpts;

/// `hira bench [--quick]` or `hira bench fairness ...`.
pub fn bench(args: Vec<String>) -> Result<u8> {
    if args.first().map(String::as_str) == Some("fairness") {
        return fairness(args[1..].to_vec());
    }
    let mut quick = false;
    for a in &args {
        match a.as_str() {
            "--quick" => quick = true,
            other => bail!("unknown argument {other:?} for bench"),
        }
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
    let native = worker(false)?;
    let hira = worker(true)?;
    print!("{}", hira_bench::table(&native, &hira));
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
    if o.tenants == 0 || o.seconds <= 0.0 {
        bail!("--tenants and --seconds must be positive");
    }
    print!("{}", hira_bench::fair::fairness(&o)?);
    Ok(0)
}
