//! Device-memory accounting in the router: every tenant's allocations charged against its
//! quota and the device's capacity × over-commit ratio ([`MemLedger`]), and the memory
//! objects each charge is bound to.
//!
//! An allocating request is charged before it is forwarded (a provisional reservation keyed
//! by connection and sequence number). Its reply binds the reservation to the new object's
//! id, or returns it if the call failed. Retains and releases keep a reference count per
//! id; the last release returns the bytes. A sub-buffer allocates nothing but keeps its
//! parent alive. No I/O here: the router feeds it what it sees on the wire.

use std::collections::HashMap;

use hira_policy::mem::{BufferId, MemError, MemLedger, TenantId};

/// A charge not yet bound to an object: the call is on its way to the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pending {
    /// An allocation of this ledger reservation, of so many bytes.
    Alloc(BufferId, u64),
    /// A sub-buffer of this parent object.
    Sub { parent: u64 },
}

/// A live memory object of a tenant, as the router counts its references.
#[derive(Debug, Clone, Copy)]
struct Obj {
    refs: u64,
    /// The ledger reservation holding its bytes (none for sub-buffers).
    res: Option<BufferId>,
    /// The object a sub-buffer keeps alive.
    parent: Option<u64>,
}

#[derive(Debug, Default)]
struct TenantObjs {
    /// By (connection id, sequence number) of the creating call.
    pending: HashMap<(u64, u64), Pending>,
    live: HashMap<u64, Obj>,
}

/// Device-memory bookkeeping of every tenant.
#[derive(Debug)]
pub struct MemAccounts {
    ledger: MemLedger,
    next_res: BufferId,
    tenants: HashMap<TenantId, TenantObjs>,
}

impl MemAccounts {
    /// Accounts for a device of `capacity` bytes (None: unlimited) whose allocations may sum
    /// to capacity × `overcommit`.
    pub fn new(capacity: Option<u64>, overcommit: f64) -> Result<MemAccounts, MemError> {
        Ok(MemAccounts {
            ledger: MemLedger::new(capacity.unwrap_or(u64::MAX), overcommit)?,
            next_res: 1,
            tenants: HashMap::new(),
        })
    }

    /// Starts accounting for tenant `t` with `quota` bytes (None: bounded by the device only).
    pub fn add_tenant(&mut self, t: TenantId, quota: Option<u64>) {
        self.tenants.entry(t).or_default();
        self.ledger.set_quota(t, quota);
    }

    /// Forgets `t` and frees everything it held.
    pub fn remove_tenant(&mut self, t: TenantId) {
        self.tenants.remove(&t);
        self.ledger.remove_tenant(t);
    }

    /// Changes `t`'s quota. Buffers it already holds are kept even above the new quota.
    pub fn set_quota(&mut self, t: TenantId, quota: Option<u64>) {
        if self.tenants.contains_key(&t) {
            self.ledger.set_quota(t, quota);
        }
    }

    /// Bytes `t` holds, reservations in flight included.
    pub fn used(&self, t: TenantId) -> u64 {
        self.ledger.used(t)
    }

    /// Bytes all tenants hold.
    pub fn committed(&self) -> u64 {
        self.ledger.committed()
    }

    /// capacity × over-commit ratio (`u64::MAX`: unlimited).
    pub fn commit_limit(&self) -> u64 {
        self.ledger.commit_limit()
    }

    /// The device memory `t` should be shown (its quota, at most the capacity); None when
    /// neither is set, so the device's own sizes stand.
    pub fn visible(&self, t: TenantId) -> Option<u64> {
        Some(self.ledger.visible_global_mem(t)).filter(|&v| v != u64::MAX)
    }

    /// Reserves `bytes` for the allocating call `seq` on connection `conn` of `t`. Nothing
    /// changes when it is refused; unknown tenants (gone) are not charged.
    pub fn reserve(
        &mut self,
        t: TenantId,
        conn: u64,
        seq: u64,
        bytes: u64,
    ) -> Result<(), MemError> {
        let Some(objs) = self.tenants.get_mut(&t) else {
            return Ok(());
        };
        let res = self.next_res;
        self.ledger.charge(t, res, bytes)?;
        self.next_res += 1;
        if let Some(Pending::Alloc(old, _)) =
            objs.pending.insert((conn, seq), Pending::Alloc(res, bytes))
        {
            // A reused sequence number: the earlier call can no longer be told apart.
            self.ledger.release(t, old);
        }
        Ok(())
    }

    /// The call `seq` on `conn` creates a sub-buffer of `parent`.
    pub fn expect_sub(&mut self, t: TenantId, conn: u64, seq: u64, parent: u64) {
        let Some(objs) = self.tenants.get_mut(&t) else {
            return;
        };
        if let Some(Pending::Alloc(old, _)) =
            objs.pending.insert((conn, seq), Pending::Sub { parent })
        {
            self.ledger.release(t, old);
        }
    }

    /// Whether the call `seq` on `conn` of `t` awaits its reply here.
    #[cfg(test)]
    fn is_pending(&self, t: TenantId, conn: u64, seq: u64) -> bool {
        self.tenants
            .get(&t)
            .is_some_and(|o| o.pending.contains_key(&(conn, seq)))
    }

    /// The reply to call `seq` on `conn` came back: `created` is the new object's id, None
    /// if the call failed (its reservation is returned). Returns the bytes now bound to
    /// the new object (None for sub-buffers, failures and calls not awaited here).
    pub fn reply(&mut self, t: TenantId, conn: u64, seq: u64, created: Option<u64>) -> Option<u64> {
        let objs = self.tenants.get_mut(&t)?;
        let p = objs.pending.remove(&(conn, seq))?;
        let bytes = match p {
            Pending::Alloc(_, b) => Some(b),
            Pending::Sub { .. } => None,
        };
        let obj = match (p, created) {
            (Pending::Alloc(res, _), Some(_)) => Obj {
                refs: 1,
                res: Some(res),
                parent: None,
            },
            (Pending::Sub { parent }, Some(_)) => {
                let parent = objs.live.get_mut(&parent).map(|o| {
                    o.refs += 1;
                    parent
                });
                Obj {
                    refs: 1,
                    res: None,
                    parent,
                }
            }
            (Pending::Alloc(res, _), None) => {
                self.ledger.release(t, res);
                return None;
            }
            (Pending::Sub { .. }, None) => return None,
        };
        let id = created.expect("matched Some above");
        if let Some(old) = objs.live.insert(id, obj) {
            // The server reused a live id (it never does): the old object's charge stays
            // only as long as the new one's would, so drop the older reservation.
            if let Some(res) = old.res {
                self.ledger.release(t, res);
            }
        }
        bytes
    }

    /// Every call of connection `conn` still awaiting its reply is abandoned (the
    /// connection closed: the guest can never learn or release those objects).
    pub fn drop_conn(&mut self, t: TenantId, conn: u64) {
        let Some(objs) = self.tenants.get_mut(&t) else {
            return;
        };
        let ledger = &mut self.ledger;
        objs.pending.retain(|&(c, _), p| {
            if c != conn {
                return true;
            }
            if let Pending::Alloc(res, _) = p {
                ledger.release(t, *res);
            }
            false
        });
    }

    /// `clRetainMemObject(id)`.
    pub fn retain(&mut self, t: TenantId, id: u64) {
        if let Some(o) = self.tenants.get_mut(&t).and_then(|o| o.live.get_mut(&id)) {
            o.refs += 1;
        }
    }

    /// `clReleaseMemObject(id)`: the last reference frees the object's bytes (and a
    /// sub-buffer's hold on its parent). Returns the objects that went away.
    pub fn release(&mut self, t: TenantId, id: u64) -> Vec<u64> {
        let mut freed = Vec::new();
        let Some(objs) = self.tenants.get_mut(&t) else {
            return freed;
        };
        let mut next = Some(id);
        while let Some(id) = next.take() {
            let Some(o) = objs.live.get_mut(&id) else {
                break;
            };
            o.refs -= 1;
            if o.refs > 0 {
                break;
            }
            let o = objs.live.remove(&id).expect("looked up above");
            if let Some(res) = o.res {
                self.ledger.release(t, res);
            }
            freed.push(id);
            next = o.parent;
        }
        freed
    }

    /// Live objects of `t` the router tracks.
    #[cfg(test)]
    fn objects(&self, t: TenantId) -> usize {
        self.tenants.get(&t).map_or(0, |o| o.live.len())
    }
}

/// The OpenCL error a refused allocation is answered with.
pub fn refusal_code(e: &MemError) -> i32 {
    match e {
        MemError::OverCommit { .. } => hira_opencl::cl::CL_OUT_OF_RESOURCES,
        _ => hira_opencl::cl::CL_MEM_OBJECT_ALLOCATION_FAILURE,
    }
}

/// Device-memory bytes an allocating request asks for, by the spec's `allocates`
/// expression decoded from the payload (buffers, images, pipes). None when it cannot be read.
pub fn request_bytes(opcode: u16, payload: &[u8]) -> Option<u64> {
    hira_opencl::alloc_request_bytes(opcode, payload)
}

/// The object a creating call's reply names: payload `[status i32][deferred i32 if
/// flagged][errcode i32][id u64]`; None unless the call succeeded.
pub fn created_id(payload: &[u8], deferred: bool) -> Option<u64> {
    let mut r = hira_wire::Reader::new(payload);
    let status = r.i32().ok()?;
    if deferred {
        r.i32().ok()?;
    }
    let errcode = r.i32().ok()?;
    let id = r.u64().ok()?;
    (status == 0 && errcode == 0 && id != 0).then_some(id)
}

/// Parses `"64MiB"`, `"512 KiB"`, `"1GiB"`, `"4096"` (bytes); units KiB, MiB, GiB, TiB
/// (also K, M, G, T and KB, MB, GB, TB, all powers of 1024) and B.
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().ok()?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return None,
    };
    n.checked_mul(1u64 << shift)
}

/// `"64MiB"` style text for a size (exact: the largest unit that divides it).
pub fn format_size(n: u64) -> String {
    for (shift, unit) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if n != 0 && n.is_multiple_of(1u64 << shift) {
            return format!("{}{unit}", n >> shift);
        }
    }
    format!("{n}B")
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn accounts(quota: u64) -> MemAccounts {
        let mut a = MemAccounts::new(None, 1.0).unwrap();
        a.add_tenant(1, Some(quota));
        a
    }

    #[test]
    fn reservation_binds_to_the_created_object_and_release_frees_it() {
        let mut a = accounts(10 * MIB);
        a.reserve(1, 7, 1, 4 * MIB).unwrap();

        a.reply(1, 7, 1, Some(100));
        let held = a.used(1);
        a.release(1, 100);

        assert_eq!(held, 4 * MIB);
        assert_eq!(a.used(1), 0);
        assert_eq!(a.objects(1), 0);
    }

    #[test]
    fn failed_call_returns_its_reservation() {
        let mut a = accounts(10 * MIB);
        a.reserve(1, 7, 1, 4 * MIB).unwrap();

        a.reply(1, 7, 1, None);

        assert_eq!(a.used(1), 0);
        assert!(!a.is_pending(1, 7, 1));
    }

    #[test]
    fn reservations_in_flight_count_against_the_quota() {
        let mut a = accounts(10 * MIB);
        a.reserve(1, 7, 1, 6 * MIB).unwrap();

        let second = a.reserve(1, 8, 1, 6 * MIB);

        assert!(matches!(second, Err(MemError::OverQuota { .. })));
        assert_eq!(a.used(1), 6 * MIB);
    }

    #[test]
    fn over_quota_and_over_capacity_map_to_their_codes() {
        let mut a = MemAccounts::new(Some(8 * MIB), 1.0).unwrap();
        a.add_tenant(1, Some(4 * MIB));
        a.add_tenant(2, None);

        let quota = a.reserve(1, 1, 1, 5 * MIB).unwrap_err();
        let device = a.reserve(2, 1, 1, 9 * MIB).unwrap_err();

        assert_eq!(refusal_code(&quota), -4);
        assert_eq!(refusal_code(&device), -5);
    }

    #[test]
    fn overcommit_ratio_raises_the_device_limit() {
        let mut a = MemAccounts::new(Some(8 * MIB), 1.5).unwrap();
        a.add_tenant(1, None);

        let fits = a.reserve(1, 1, 1, 12 * MIB);

        assert_eq!(fits, Ok(()));
        assert_eq!(a.commit_limit(), 12 * MIB);
    }

    #[test]
    fn retained_object_is_freed_by_its_last_release() {
        let mut a = accounts(10 * MIB);
        a.reserve(1, 7, 1, MIB).unwrap();
        a.reply(1, 7, 1, Some(100));
        a.retain(1, 100);

        a.release(1, 100);
        let after_first = a.used(1);
        a.release(1, 100);

        assert_eq!(after_first, MIB);
        assert_eq!(a.used(1), 0);
    }

    #[test]
    fn extra_releases_and_unknown_ids_are_harmless() {
        let mut a = accounts(10 * MIB);
        a.reserve(1, 7, 1, MIB).unwrap();
        a.reply(1, 7, 1, Some(100));

        a.release(1, 100);
        a.release(1, 100);
        a.release(1, 555);
        a.retain(1, 555);

        assert_eq!(a.used(1), 0);
        assert_eq!(a.committed(), 0);
    }

    #[test]
    fn sub_buffer_keeps_its_parent_charged() {
        let mut a = accounts(10 * MIB);
        a.reserve(1, 7, 1, 2 * MIB).unwrap();
        a.reply(1, 7, 1, Some(100));
        a.expect_sub(1, 7, 2, 100);
        a.reply(1, 7, 2, Some(101));

        a.release(1, 100);
        let parent_released = a.used(1);
        a.release(1, 101);

        assert_eq!(parent_released, 2 * MIB);
        assert_eq!(a.used(1), 0);
        assert_eq!(a.objects(1), 0);
    }

    #[test]
    fn sub_buffer_allocates_nothing() {
        let mut a = accounts(10 * MIB);
        a.reserve(1, 7, 1, 2 * MIB).unwrap();
        a.reply(1, 7, 1, Some(100));

        a.expect_sub(1, 7, 2, 100);
        a.reply(1, 7, 2, Some(101));

        assert_eq!(a.used(1), 2 * MIB);
    }

    #[test]
    fn lowered_quota_keeps_buffers_and_refuses_new_ones() {
        let mut a = accounts(10 * MIB);
        a.reserve(1, 7, 1, 8 * MIB).unwrap();
        a.reply(1, 7, 1, Some(100));

        a.set_quota(1, Some(4 * MIB));
        let grow = a.reserve(1, 7, 2, 1);

        assert!(matches!(grow, Err(MemError::OverQuota { .. })));
        assert_eq!(a.used(1), 8 * MIB);
    }

    #[test]
    fn closed_connection_returns_its_reservations_only() {
        let mut a = accounts(10 * MIB);
        a.reserve(1, 7, 1, MIB).unwrap();
        a.reserve(1, 8, 1, 2 * MIB).unwrap();

        a.drop_conn(1, 7);

        assert_eq!(a.used(1), 2 * MIB);
        assert!(a.is_pending(1, 8, 1));
    }

    #[test]
    fn removed_tenant_frees_everything_and_is_not_charged_again() {
        let mut a = accounts(10 * MIB);
        a.reserve(1, 7, 1, MIB).unwrap();
        a.reply(1, 7, 1, Some(100));
        a.reserve(1, 7, 2, MIB).unwrap();

        a.remove_tenant(1);
        let late = a.reserve(1, 7, 3, 20 * MIB);

        assert_eq!(late, Ok(()));
        assert_eq!(a.committed(), 0);
    }

    #[test]
    fn visible_size_is_quota_capped_by_capacity() {
        let mut a = MemAccounts::new(Some(8 * MIB), 1.0).unwrap();
        a.add_tenant(1, Some(4 * MIB));
        a.add_tenant(2, Some(16 * MIB));
        a.add_tenant(3, None);
        let mut b = MemAccounts::new(None, 1.0).unwrap();
        b.add_tenant(1, None);

        assert_eq!(a.visible(1), Some(4 * MIB));
        assert_eq!(a.visible(2), Some(8 * MIB));
        assert_eq!(a.visible(3), Some(8 * MIB));
        assert_eq!(b.visible(1), None);
    }

    #[test]
    fn created_id_reads_success_and_failure() {
        let ok = [0i32.to_le_bytes(), 0i32.to_le_bytes()].concat();
        let ok = [ok, 42u64.to_le_bytes().to_vec()].concat();
        let deferred = [
            0i32.to_le_bytes().to_vec(),
            (-30i32).to_le_bytes().to_vec(),
            ok[4..].to_vec(),
        ]
        .concat();
        let failed = [0i32.to_le_bytes(), (-61i32).to_le_bytes()].concat();
        let failed = [failed, 0u64.to_le_bytes().to_vec()].concat();

        assert_eq!(created_id(&ok, false), Some(42));
        assert_eq!(created_id(&deferred, true), Some(42));
        assert_eq!(created_id(&failed, false), None);
        assert_eq!(created_id(&(-4i32).to_le_bytes(), false), None);
    }

    #[test]
    fn pipe_size_is_packets_times_packet_size() {
        let mut w = hira_wire::Writer::default();
        w.u64(1);
        w.u64(0);
        w.u64(64);
        w.u64(1000);
        w.blob(hira_wire::Blob::Null); // properties

        assert_eq!(
            request_bytes(hira_opencl::OP_CLCREATEPIPE, &w.buf),
            Some(64_000)
        );
    }

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("64MiB"), Some(64 * MIB));
        assert_eq!(parse_size("512 KiB"), Some(512 << 10));
        assert_eq!(parse_size("2G"), Some(2 << 30));
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("1.5GiB"), None);
        assert_eq!(parse_size("12 parsecs"), None);
        assert_eq!(format_size(64 * MIB), "64MiB");
        assert_eq!(format_size(1000), "1000B");
    }
}
