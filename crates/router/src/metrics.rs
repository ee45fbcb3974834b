//! Per-tenant metrics: atomic counters updated on the forwarding path, snapshotted for the
//! control API and exported in the Prometheus text format.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::dispatch::{DeviceStats, SchedView};

/// Counters of one tenant (one guest process and its API server).
#[derive(Debug)]
pub struct TenantMetrics {
    pub id: u64,
    pub pid: i32,
    /// `/proc/<pid>/comm` when the tenant was admitted.
    pub command: String,
    pub started: SystemTime,
    /// The API server is running.
    pub alive: AtomicBool,
    /// Guest connections currently open.
    pub connections: AtomicU64,
    /// API calls (request frames).
    pub calls: AtomicU64,
    calls_by_op: Box<[AtomicU64]>,
    /// Requests whose opcode is not in the spec (forwarded; the server refuses them).
    pub unknown_calls: AtomicU64,
    /// Frame bytes guest → server.
    pub bytes_in: AtomicU64,
    /// Frame bytes server → guest.
    pub bytes_out: AtomicU64,
    /// Bulk bytes moved through shared memory, as announced by request headers, and mapped
    /// in the arena for the guest to move in place.
    pub bulk: AtomicU64,
    /// Device time reported by replies.
    pub device_ns: AtomicU64,
    /// Bytes requested by allocating calls.
    pub alloc_requested: AtomicU64,
    /// Asynchronous calls dropped because the server was gone.
    pub dropped: AtomicU64,
    /// Calls answered with FAILED.
    pub failed: AtomicU64,
    /// Malformed frames received from the guest.
    pub bad_frames: AtomicU64,
    /// Latest USAGE sample from the server: device time total.
    pub usage_device_ns: AtomicU64,
    /// Reply bytes the server sent straight to the guest (from its USAGE samples).
    pub bytes_out_direct: AtomicU64,
    /// Latest USAGE sample: device memory held.
    pub mem_bytes: AtomicU64,
    /// Latest USAGE sample: live API objects.
    pub objects: AtomicU64,
    /// Device memory the router has charged to the tenant (reservations in flight included).
    pub mem_held: AtomicU64,
    /// The tenant's device-memory quota (0: none).
    pub mem_quota: AtomicU64,
    /// Allocations the router refused (over quota or over the device's capacity).
    pub alloc_refused: AtomicU64,
    /// The scheduler's last view of the tenant, kept once it has left the scheduler.
    pub final_sched: std::sync::Mutex<Option<SchedView>>,
}

impl TenantMetrics {
    /// Fresh counters for a tenant.
    pub fn new(id: u64, pid: i32, command: String) -> TenantMetrics {
        TenantMetrics {
            id,
            pid,
            command,
            started: SystemTime::now(),
            alive: AtomicBool::new(true),
            connections: AtomicU64::new(0),
            calls: AtomicU64::new(0),
            calls_by_op: (0..hira_opencl::OPS.len())
                .map(|_| AtomicU64::new(0))
                .collect(),
            unknown_calls: AtomicU64::new(0),
            bytes_in: AtomicU64::new(0),
            bytes_out: AtomicU64::new(0),
            bulk: AtomicU64::new(0),
            device_ns: AtomicU64::new(0),
            alloc_requested: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            bad_frames: AtomicU64::new(0),
            usage_device_ns: AtomicU64::new(0),
            bytes_out_direct: AtomicU64::new(0),
            mem_bytes: AtomicU64::new(0),
            objects: AtomicU64::new(0),
            mem_held: AtomicU64::new(0),
            mem_quota: AtomicU64::new(0),
            alloc_refused: AtomicU64::new(0),
            final_sched: std::sync::Mutex::new(None),
        }
    }

    /// Counts one API call by opcode.
    pub fn count_call(&self, opcode: u16) {
        self.calls.fetch_add(1, Relaxed);
        match usize::from(opcode)
            .checked_sub(1)
            .and_then(|i| self.calls_by_op.get(i))
        {
            Some(c) => c.fetch_add(1, Relaxed),
            None => self.unknown_calls.fetch_add(1, Relaxed),
        };
    }

    /// A consistent-enough copy for reporting.
    pub fn snapshot(&self) -> TenantStats {
        let calls_by_op = self
            .calls_by_op
            .iter()
            .zip(hira_opencl::OPS.iter())
            .filter_map(|(c, info)| {
                let n = c.load(Relaxed);
                (n > 0).then(|| (info.name.to_string(), n))
            })
            .collect();
        TenantStats {
            id: self.id,
            pid: self.pid,
            command: self.command.clone(),
            alive: self.alive.load(Relaxed),
            started_unix_ms: self
                .started
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            connections: self.connections.load(Relaxed),
            calls: self.calls.load(Relaxed),
            calls_by_op,
            unknown_calls: self.unknown_calls.load(Relaxed),
            bytes_in: self.bytes_in.load(Relaxed),
            bytes_out: self.bytes_out.load(Relaxed) + self.bytes_out_direct.load(Relaxed),
            bulk: self.bulk.load(Relaxed),
            device_ns: self
                .device_ns
                .load(Relaxed)
                .max(self.usage_device_ns.load(Relaxed)),
            alloc_requested: self.alloc_requested.load(Relaxed),
            mem_bytes: self.mem_bytes.load(Relaxed),
            objects: self.objects.load(Relaxed),
            mem_held: self.mem_held.load(Relaxed),
            mem_quota: self.mem_quota.load(Relaxed),
            alloc_refused: self.alloc_refused.load(Relaxed),
            dropped: self.dropped.load(Relaxed),
            failed: self.failed.load(Relaxed),
            bad_frames: self.bad_frames.load(Relaxed),
            sched: self
                .final_sched
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
                .unwrap_or_default(),
        }
    }
}

/// A snapshot of one tenant's metrics, as the control API reports it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TenantStats {
    pub id: u64,
    pub pid: i32,
    pub command: String,
    pub alive: bool,
    pub started_unix_ms: u64,
    pub connections: u64,
    pub calls: u64,
    pub calls_by_op: BTreeMap<String, u64>,
    pub unknown_calls: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub bulk: u64,
    /// The larger of the replies' device time and the server's latest USAGE total.
    pub device_ns: u64,
    pub alloc_requested: u64,
    /// Device memory held by the server's count (USAGE).
    pub mem_bytes: u64,
    pub objects: u64,
    /// Device memory charged by the router (its own view, from the allocation sizes).
    #[serde(default)]
    pub mem_held: u64,
    /// Device-memory quota in bytes; 0 = none.
    #[serde(default)]
    pub mem_quota: u64,
    /// Allocations refused by the router.
    #[serde(default)]
    pub alloc_refused: u64,
    pub dropped: u64,
    pub failed: u64,
    pub bad_frames: u64,
    /// Scheduling: settings, kernels, queue wait, throttling, stop reason.
    #[serde(default)]
    pub sched: SchedView,
}

/// Prometheus text exposition of tenant snapshots.
pub fn prometheus(tenants: &[TenantStats]) -> String {
    let mut out = String::new();
    let gauges: [(&str, &str, fn(&TenantStats) -> u64); 25] = [
        ("hira_tenant_alive", "API server running", |t| {
            u64::from(t.alive)
        }),
        ("hira_tenant_connections", "open guest connections", |t| {
            t.connections
        }),
        ("hira_tenant_calls_total", "API calls", |t| t.calls),
        (
            "hira_tenant_bytes_in_total",
            "frame bytes guest to server",
            |t| t.bytes_in,
        ),
        (
            "hira_tenant_bytes_out_total",
            "frame bytes server to guest",
            |t| t.bytes_out,
        ),
        (
            "hira_tenant_bulk_bytes_total",
            "bulk bytes via shared memory",
            |t| t.bulk,
        ),
        ("hira_tenant_device_ns_total", "device time in ns", |t| {
            t.device_ns
        }),
        (
            "hira_tenant_alloc_requested_bytes_total",
            "bytes requested by allocations",
            |t| t.alloc_requested,
        ),
        ("hira_tenant_mem_bytes", "device memory held", |t| {
            t.mem_bytes
        }),
        ("hira_tenant_objects", "live API objects", |t| t.objects),
        (
            "hira_tenant_mem_held_bytes",
            "device memory charged by the router",
            |t| t.mem_held,
        ),
        (
            "hira_tenant_mem_quota_bytes",
            "device-memory quota (0 = none)",
            |t| t.mem_quota,
        ),
        (
            "hira_tenant_alloc_refused_total",
            "allocations refused by the router",
            |t| t.alloc_refused,
        ),
        ("hira_tenant_dropped_total", "async calls dropped", |t| {
            t.dropped
        }),
        ("hira_tenant_failed_total", "calls answered FAILED", |t| {
            t.failed
        }),
        (
            "hira_tenant_bad_frames_total",
            "malformed guest frames",
            |t| t.bad_frames,
        ),
        (
            "hira_tenant_kernels_total",
            "device-time commands done",
            |t| t.sched.kernels,
        ),
        (
            "hira_tenant_kernel_ns_total",
            "device time of commands done, in ns",
            |t| t.sched.kernel_ns,
        ),
        (
            "hira_tenant_charged_ns_total",
            "device time charged by the scheduler, in ns",
            |t| t.sched.charged_ns,
        ),
        (
            "hira_tenant_queue_wait_ns_total",
            "time commands waited for the scheduler, in ns",
            |t| t.sched.queue_wait_ns,
        ),
        (
            "hira_tenant_throttled_ns_total",
            "time held back by the cap, in ns",
            |t| t.sched.throttled_ns,
        ),
        ("hira_tenant_waiting", "commands waiting to dispatch", |t| {
            u64::from(t.sched.waiting)
        }),
        ("hira_tenant_inflight", "commands on the device", |t| {
            u64::from(t.sched.inflight)
        }),
        ("hira_tenant_weight", "scheduling weight", |t| {
            u64::from(t.sched.weight)
        }),
        ("hira_tenant_stopped", "stopped by the router", |t| {
            u64::from(t.sched.stopped.is_some())
        }),
    ];
    for (name, help, get) in gauges {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for t in tenants {
            let _ = writeln!(
                out,
                "{name}{{tenant=\"{}\",pid=\"{}\",command=\"{}\"}} {}",
                t.id,
                t.pid,
                escape(&t.command),
                get(t)
            );
        }
    }
    let _ = writeln!(
        out,
        "# HELP hira_tenant_op_calls_total API calls by function\n# TYPE hira_tenant_op_calls_total counter"
    );
    for t in tenants {
        for (op, n) in &t.calls_by_op {
            let _ = writeln!(
                out,
                "hira_tenant_op_calls_total{{tenant=\"{}\",op=\"{op}\"}} {n}",
                t.id
            );
        }
    }
    out
}

/// Prometheus text of tenants and the device's scheduler.
pub fn prometheus_with_device(tenants: &[TenantStats], device: &DeviceStats) -> String {
    let mut out = prometheus(tenants);
    let d = device;
    let rows: [(&str, &str, u64); 8] = [
        (
            "hira_device_busy_ns_total",
            "time with a command on the device, in ns",
            d.busy_ns,
        ),
        (
            "hira_device_uptime_ns",
            "time since the router started, in ns",
            d.uptime_ns,
        ),
        (
            "hira_device_inflight",
            "commands on the device",
            u64::from(d.inflight),
        ),
        (
            "hira_device_max_inflight",
            "commands allowed on the device",
            u64::from(d.max_inflight),
        ),
        (
            "hira_device_waiting",
            "commands waiting for the scheduler",
            u64::from(d.waiting),
        ),
        (
            "hira_device_dispatched_total",
            "commands dispatched",
            d.dispatched,
        ),
        ("hira_device_completed_total", "commands done", d.completed),
        (
            "hira_device_runaways_total",
            "tenants stopped for a runaway command",
            d.runaways,
        ),
    ];
    for (name, help, v) in rows {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{device=\"0\",policy=\"{}\"}} {v}",
            escape(&d.policy)
        );
    }
    out
}

/// The device's memory as the router accounts it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryStats {
    /// Configured capacity (`memory.capacity`); None: unlimited.
    pub capacity: Option<u64>,
    /// What all tenants together may hold: capacity × overcommit; None: unlimited.
    pub limit: Option<u64>,
    /// Held by all live tenants.
    pub committed: u64,
    /// Allocations refused since the router started.
    pub refused: u64,
    /// Over-subscription: placement, residency and swap totals (None when off).
    #[serde(default)]
    pub swap: Option<Box<crate::swap::SwapView>>,
}

/// Prometheus text of the device's memory accounting.
pub fn prometheus_memory(m: &MemoryStats) -> String {
    let mut out = String::new();
    let rows: [(&str, &str, Option<u64>); 4] = [
        (
            "hira_device_mem_capacity_bytes",
            "configured device memory",
            m.capacity,
        ),
        (
            "hira_device_mem_limit_bytes",
            "device memory tenants may hold together",
            m.limit,
        ),
        (
            "hira_device_mem_committed_bytes",
            "device memory charged to tenants",
            Some(m.committed),
        ),
        (
            "hira_device_alloc_refused_total",
            "allocations refused by the router",
            Some(m.refused),
        ),
    ];
    for (name, help, v) in rows {
        if let Some(v) = v {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{device=\"0\"}} {v}"
            );
        }
    }
    if let Some(sw) = &m.swap {
        let t = &sw.totals;
        let rows: [(&str, &str, &str, u64); 9] = [
            (
                "hira_device_mem_resident_bytes",
                "gauge",
                "bytes of buffers on the device in the slots",
                sw.resident_bytes,
            ),
            (
                "hira_device_mem_pinned_bytes",
                "gauge",
                "bytes of buffers that cannot be swapped",
                t.pinned_bytes,
            ),
            (
                "hira_swap_evicted_bytes_total",
                "counter",
                "bytes copied from the device to host memory",
                t.bytes_evicted,
            ),
            (
                "hira_swap_restored_bytes_total",
                "counter",
                "bytes copied back to the device",
                t.bytes_restored,
            ),
            (
                "hira_swap_evictions_total",
                "counter",
                "buffers copied out",
                t.buffers_evicted,
            ),
            (
                "hira_swap_restores_total",
                "counter",
                "buffers copied back",
                t.buffers_restored,
            ),
            (
                "hira_swap_switches_total",
                "counter",
                "commands that waited for evictions",
                t.swaps,
            ),
            (
                "hira_swap_seconds_total",
                "counter",
                "time spent evicting and restoring, in ns",
                t.evict_ns + t.restore_ns,
            ),
            (
                "hira_placements_total",
                "counter",
                "slot placements computed",
                t.placements,
            ),
        ];
        for (name, kind, help, v) in rows {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{device=\"0\",placement=\"{}\"}} {v}",
                escape(&sw.placement)
            );
        }
        let name = "hira_tenant_mem_resident_bytes";
        let _ = writeln!(
            out,
            "# HELP {name} bytes of the tenant's buffers on the device\n# TYPE {name} gauge"
        );
        for tn in &sw.tenants {
            let _ = writeln!(
                out,
                "{name}{{tenant=\"{}\"}} {}",
                tn.tenant, tn.resident_bytes
            );
        }
    }
    out
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_counted_by_name() {
        let m = TenantMetrics::new(1, 2, "app".into());

        m.count_call(hira_opencl::OP_CLCREATEBUFFER);
        m.count_call(hira_opencl::OP_CLCREATEBUFFER);
        m.count_call(u16::MAX);
        let s = m.snapshot();

        assert_eq!(s.calls, 3);
        assert_eq!(s.calls_by_op.get("clCreateBuffer"), Some(&2));
        assert_eq!(s.unknown_calls, 1);
    }

    #[test]
    fn prometheus_text_names_tenants() {
        let m = TenantMetrics::new(7, 42, "a\"b".into());
        m.count_call(hira_opencl::OP_CLCREATEBUFFER);

        let text = prometheus(&[m.snapshot()]);

        assert!(
            text.contains("hira_tenant_calls_total{tenant=\"7\",pid=\"42\",command=\"a\\\"b\"} 1")
        );
        assert!(text.contains("op=\"clCreateBuffer\"} 1"));
    }

    #[test]
    fn memory_gauges_are_exported() {
        let m = TenantMetrics::new(7, 42, "app".into());
        m.mem_held.store(4096, Relaxed);
        m.mem_quota.store(8192, Relaxed);
        m.alloc_refused.store(2, Relaxed);
        let device = MemoryStats {
            committed: 4096,
            refused: 2,
            ..MemoryStats::default()
        };

        let text = prometheus(&[m.snapshot()]) + &prometheus_memory(&device);

        assert!(text
            .contains("hira_tenant_mem_held_bytes{tenant=\"7\",pid=\"42\",command=\"app\"} 4096"));
        assert!(text
            .contains("hira_tenant_mem_quota_bytes{tenant=\"7\",pid=\"42\",command=\"app\"} 8192"));
        assert!(text.contains(
            "hira_tenant_alloc_refused_total{tenant=\"7\",pid=\"42\",command=\"app\"} 2"
        ));
        assert!(text.contains("hira_device_mem_committed_bytes{device=\"0\"} 4096"));
        assert!(!text.contains("hira_device_mem_capacity_bytes{"));
    }
}
