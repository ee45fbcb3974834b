//! Cross-policy tests on the fake device ([`super::sim`]) and property tests.

use proptest::prelude::*;

use super::sim::{
    fairness, run, two_tenant_fairness, Fairness, ParamChange, SimConfig, SimTenant, Spread,
};
use super::*;

/// Picks and completes `steps` commands of `kernel` ns from `start`; the tenant run at each
/// step, 0 for a step where nothing ran (a `Wait` advances the clock to its end).
pub(super) fn dispatch_order(
    s: &mut dyn Scheduler,
    start: Nanos,
    steps: usize,
    kernel: Nanos,
) -> Vec<TenantId> {
    let mut now = start;
    (0..steps)
        .map(|_| match s.pick(now) {
            Decision::Run(t) => {
                now += kernel;
                s.complete(t, kernel, now);
                t
            }
            Decision::Wait { until } => {
                now = until.max(now);
                0
            }
            Decision::Idle => 0,
        })
        .collect()
}

const SECOND: Nanos = 1000 * MS;

/// Policies that share the device by weight.
const PROPORTIONAL: [PolicyKind; 7] = [
    PolicyKind::Credit,
    PolicyKind::Band,
    PolicyKind::AccC,
    PolicyKind::Slaf,
    PolicyKind::Wfq,
    PolicyKind::WfqFixedRate,
    PolicyKind::WfqAimd,
];

#[test]
fn policy_names_round_trip() {
    let parsed: Vec<PolicyKind> = PolicyKind::ALL
        .iter()
        .map(|k| k.to_string().parse().expect("own name parses"))
        .collect();

    assert_eq!(parsed, PolicyKind::ALL);
    assert_eq!(
        "lottery".parse::<PolicyKind>(),
        Err(SchedError::UnknownPolicy("lottery".into()))
    );
}

#[test]
fn config_rejects_zero_intervals() {
    let cfg = SchedConfig {
        period: 0,
        ..SchedConfig::default()
    };

    assert_eq!(cfg.validate(), Err(SchedError::ZeroInterval("period")));
    assert_eq!(SchedConfig::default().validate(), Ok(()));
}

#[test]
fn params_reject_cap_out_of_range() {
    let p = TenantParams {
        cap: Some(1.5),
        ..TenantParams::default()
    };

    assert!(p.validate().is_err());
    assert!(TenantParams::default().validate().is_ok());
}

fn print_table(title: &str, rows: &[Fairness]) {
    eprintln!("{title}");
    for r in rows {
        eprintln!(
            "{:>9}: 500ms median {:5.1}% max {:5.1}% | 1s median {:5.1}% max {:5.1}% | util {:5.1}%",
            r.kind.name(),
            100.0 * r.half_second.median,
            100.0 * r.half_second.max,
            100.0 * r.second.median,
            100.0 * r.second.max,
            100.0 * r.utilization
        );
    }
}

/// Kernels around 1 ms and around 5 ms, not multiples of each other.
fn jittered_pair() -> [SimTenant; 2] {
    let short = [800, 1300, 900, 1100, 1000, 1200, 700].map(|us| us * US);
    let long = [4100, 6300, 5200, 4700, 5900, 3800].map(|us| us * US);
    [
        SimTenant::busy(1, MS).with_kernels(short.to_vec()),
        SimTenant::busy(2, 5 * MS).with_kernels(long.to_vec()),
    ]
}

/// The AvA §5.6.5 experiment for every policy, printed: fixed 1 ms vs 5 ms kernels,
/// jittered ones, and synchronous clients (50 µs between completion and next submission).
/// Every policy keeps the device busy.
#[test]
fn fairness_table_1ms_vs_5ms() {
    let fixed: Vec<Fairness> = PolicyKind::ALL
        .iter()
        .map(|&k| two_tenant_fairness(k, MS, 5 * MS, 20 * SECOND))
        .collect();
    let jittered: Vec<Fairness> = PolicyKind::ALL
        .iter()
        .map(|&k| fairness(k, jittered_pair(), 20 * SECOND))
        .collect();
    let sync_pair = || {
        [
            SimTenant::synchronous(1, MS, 50 * US),
            SimTenant::synchronous(2, 5 * MS, 50 * US),
        ]
    };
    let synchronous: Vec<Fairness> = PolicyKind::ALL
        .iter()
        .map(|&k| fairness(k, sync_pair(), 20 * SECOND))
        .collect();

    print_table("1 ms vs 5 ms, always busy", &fixed);
    print_table("~1 ms vs ~5 ms jittered, always busy", &jittered);
    print_table("1 ms vs 5 ms, synchronous clients", &synchronous);
    assert!(
        fixed.iter().chain(&jittered).all(|r| r.utilization >= 0.97),
        "{fixed:#?} {jittered:#?}"
    );
}

#[test]
fn jittered_kernels_stay_fair_under_wfq_and_band() {
    let wfq = fairness(PolicyKind::Wfq, jittered_pair(), 20 * SECOND);
    let band = fairness(PolicyKind::Band, jittered_pair(), 20 * SECOND);

    assert!(wfq.second.median <= 0.03, "{wfq:?}");
    assert!(band.second.median <= 0.03, "{band:?}");
}

#[test]
fn fifo_gives_the_long_kernel_tenant_most() {
    let cfg = SimConfig::new(
        PolicyKind::Fifo,
        10 * SECOND,
        vec![SimTenant::busy(1, MS), SimTenant::busy(2, 5 * MS)],
    );

    let report = run(&cfg);

    assert!(
        report.share_since(1, 0) > 0.8,
        "{}",
        report.share_since(1, 0)
    );
}

#[test]
fn wfq_and_band_are_fair_for_1ms_vs_5ms() {
    let wfq = two_tenant_fairness(PolicyKind::Wfq, MS, 5 * MS, 20 * SECOND);
    let band = two_tenant_fairness(PolicyKind::Band, MS, 5 * MS, 20 * SECOND);

    assert!(wfq.second.median <= 0.03, "{wfq:?}");
    assert!(band.second.median <= 0.03, "{band:?}");
}

#[test]
fn every_proportional_policy_is_fair_for_1ms_vs_5ms() {
    let medians: Vec<(PolicyKind, Spread)> = PROPORTIONAL
        .iter()
        .map(|&k| (k, two_tenant_fairness(k, MS, 5 * MS, 20 * SECOND).second))
        .collect();

    assert!(
        medians.iter().all(|(_, s)| s.median <= 0.03),
        "{medians:#?}"
    );
}

fn weighted_124(kind: PolicyKind) -> Vec<f64> {
    let tenants = vec![
        SimTenant::busy(1, MS).with_weight(1),
        SimTenant::busy(2, 3 * MS).with_weight(2),
        SimTenant::busy(3, 2 * MS).with_weight(4),
    ];
    let report = run(&SimConfig::new(kind, 20 * SECOND, tenants));
    (0..3).map(|i| report.share_since(i, SECOND)).collect()
}

fn within(shares: &[f64], entitled: &[f64], tolerance: f64) -> bool {
    shares
        .iter()
        .zip(entitled)
        .all(|(s, e)| (s - e).abs() <= tolerance * e)
}

#[test]
fn weights_1_2_4_give_entitled_shares_under_wfq_and_credit() {
    let entitled = [1.0 / 7.0, 2.0 / 7.0, 4.0 / 7.0];
    let wfq = weighted_124(PolicyKind::Wfq);
    let credit = weighted_124(PolicyKind::Credit);

    assert!(within(&wfq, &entitled, 0.05), "{wfq:?}");
    assert!(within(&credit, &entitled, 0.05), "{credit:?}");
}

#[test]
fn weights_1_2_4_give_entitled_shares_under_every_proportional_policy() {
    let entitled = [1.0 / 7.0, 2.0 / 7.0, 4.0 / 7.0];
    let shares: Vec<(PolicyKind, Vec<f64>)> =
        PROPORTIONAL.iter().map(|&k| (k, weighted_124(k))).collect();

    assert!(
        shares.iter().all(|(_, s)| within(s, &entitled, 0.05)),
        "{shares:#?}"
    );
}

/// Tenant 2's weight goes from 1 to 3 at 5 s; from two 500 ms windows later on its share is 3/4.
fn share_after_weight_change(kind: PolicyKind) -> Vec<f64> {
    let mut cfg = SimConfig::new(
        kind,
        10 * SECOND,
        vec![SimTenant::busy(1, MS), SimTenant::busy(2, 5 * MS)],
    );
    cfg.changes.push(ParamChange {
        at: 5 * SECOND,
        tenant: 2,
        params: TenantParams::weighted(3),
    });
    let report = run(&cfg);
    report.shares(500 * MS)[12..]
        .iter()
        .map(|row| row[1])
        .collect()
}

#[test]
fn live_weight_change_moves_shares_within_two_windows() {
    let shares: Vec<(PolicyKind, Vec<f64>)> = PROPORTIONAL
        .iter()
        .map(|&k| (k, share_after_weight_change(k)))
        .collect();

    assert!(
        shares
            .iter()
            .all(|(_, s)| s.iter().all(|x| (x - 0.75).abs() <= 0.05)),
        "{shares:#?}"
    );
}

#[test]
fn lone_tenant_uses_the_whole_device_under_every_policy() {
    let utilization: Vec<(PolicyKind, f64, f64)> = PolicyKind::ALL
        .iter()
        .map(|&k| {
            let busy = run(&SimConfig::new(
                k,
                2 * SECOND,
                vec![SimTenant::busy(1, 3 * MS)],
            ));
            let sync = run(&SimConfig::new(
                k,
                2 * SECOND,
                vec![SimTenant::synchronous(1, 3 * MS, 0)],
            ));
            (k, busy.utilization(), sync.utilization())
        })
        .collect();

    assert!(
        utilization.iter().all(|(_, b, s)| *b >= 0.97 && *s >= 0.97),
        "{utilization:#?}"
    );
}

/// Tenant 2 (5 ms kernels) is away from 2 s to 4 s; its most device time in any 100 ms
/// window after it returns.
fn burst_after_return(kind: PolicyKind) -> Nanos {
    let tenants = vec![
        SimTenant::busy(1, MS),
        SimTenant::busy(2, 5 * MS).with_on(vec![(0, 2 * SECOND), (4 * SECOND, 10 * SECOND)]),
    ];
    let report = run(&SimConfig::new(kind, 6 * SECOND, tenants));
    report.device_ns(100 * MS)[40..]
        .iter()
        .map(|row| row[1])
        .max()
        .unwrap_or(0)
}

#[test]
fn returning_idle_tenant_gets_no_burst_beyond_one_windows_share() {
    let bursts: Vec<(PolicyKind, Nanos)> = PROPORTIONAL
        .iter()
        .map(|&k| (k, burst_after_return(k)))
        .collect();

    assert!(
        bursts.iter().all(|(_, b)| *b <= 50 * MS + 5 * MS),
        "{bursts:#?}"
    );
}

/// Tenant 1 capped at 0.25 with 3 ms kernels, alone or beside an uncapped tenant; its most
/// device time in any 100 ms window.
fn capped_peak(kind: PolicyKind, alone: bool) -> Nanos {
    let capped = SimTenant::busy(1, 3 * MS).with_params(TenantParams {
        cap: Some(0.25),
        ..TenantParams::default()
    });
    let tenants = if alone {
        vec![capped]
    } else {
        vec![capped, SimTenant::busy(2, MS)]
    };
    let mut cfg = SimConfig::new(kind, 5 * SECOND, tenants);
    cfg.sched.window = 100 * MS;
    let report = run(&cfg);
    report
        .device_ns(100 * MS)
        .iter()
        .map(|row| row[0])
        .max()
        .unwrap_or(0)
}

#[test]
fn capped_tenant_never_exceeds_cap_plus_one_kernel_per_window() {
    let peaks: Vec<(PolicyKind, Nanos, Nanos)> = PolicyKind::ALL
        .iter()
        .map(|&k| (k, capped_peak(k, true), capped_peak(k, false)))
        .collect();

    assert!(
        peaks.iter().all(|(_, a, b)| *a <= 28 * MS && *b <= 28 * MS),
        "{peaks:#?}"
    );
}

#[test]
fn capped_lone_tenant_is_throttled_but_not_starved() {
    let capped = SimTenant::busy(1, 3 * MS).with_params(TenantParams {
        cap: Some(0.25),
        ..TenantParams::default()
    });

    let report = run(&SimConfig::new(PolicyKind::Wfq, 5 * SECOND, vec![capped]));

    assert!(
        (0.24..=0.27).contains(&report.utilization()),
        "{}",
        report.utilization()
    );
}

/// Four equal tenants; tenant 1 promised 0.5 of the device. Its share over the last 5 s.
fn slo_share(kind: PolicyKind) -> f64 {
    let promised = TenantParams {
        slo: Some(0.5),
        ..TenantParams::default()
    };
    let tenants = vec![
        SimTenant::busy(1, 2 * MS).with_params(promised),
        SimTenant::busy(2, 2 * MS),
        SimTenant::busy(3, 3 * MS),
        SimTenant::busy(4, MS),
    ];
    let report = run(&SimConfig::new(kind, 10 * SECOND, tenants));
    report.share_since(0, 5 * SECOND)
}

#[test]
fn slaf_compensates_a_tenant_below_its_slo() {
    let accc = slo_share(PolicyKind::AccC);
    let slaf = slo_share(PolicyKind::Slaf);

    assert!((accc - 0.25).abs() < 0.02, "{accc}");
    assert!(slaf >= 0.47, "{slaf}");
}

/// GPUvm's 2-VM case: synchronous clients submit their next command only after the last
/// completes, so right after the short-kernel tenant's completion only the long-kernel
/// tenant's command is queued.
fn synchronous_unfairness(kind: PolicyKind) -> Spread {
    let tenants = vec![
        SimTenant::synchronous(1, MS, 50 * US),
        SimTenant::synchronous(2, 5 * MS, 50 * US),
    ];
    let report = run(&SimConfig::new(kind, 20 * SECOND, tenants));
    Spread::of(&report.unfairness(SECOND, 0, 1))
}

#[test]
fn band_fixes_credits_unfairness_with_synchronous_clients() {
    let credit = synchronous_unfairness(PolicyKind::Credit);
    let band = synchronous_unfairness(PolicyKind::Band);

    assert!(credit.median > 0.3, "{credit:?}");
    assert!(band.median <= 0.05, "{band:?}");
}

#[test]
fn switch_time_is_never_charged() {
    let mut cfg = SimConfig::new(
        PolicyKind::Wfq,
        SECOND,
        vec![SimTenant::busy(1, MS), SimTenant::busy(2, 2 * MS)],
    );
    cfg.switch_ns = 200 * US;

    let report = run(&cfg);
    let kernels: Vec<Nanos> = (0..2)
        .map(|i| {
            let done = report
                .busy
                .iter()
                .filter(|b| b.tenant == i && b.end <= SECOND);
            done.map(|b| b.end - b.start).sum()
        })
        .collect();

    assert_eq!(report.charged, kernels);
}

fn arb_tenants() -> impl Strategy<Value = Vec<SimTenant>> {
    let tenant = (1u32..=4, prop::collection::vec(100 * US..=10 * MS, 1..4));
    prop::collection::vec(tenant, 2..=8).prop_map(|ts| {
        ts.into_iter()
            .enumerate()
            .map(|(i, (w, kernels))| {
                SimTenant::busy(i as TenantId + 1, MS)
                    .with_weight(w)
                    .with_kernels(kernels)
            })
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Every tenant with work is dispatched within a bound, under every policy.
    #[test]
    fn nobody_starves(tenants in arb_tenants()) {
        let longest: Vec<(PolicyKind, Nanos)> = PolicyKind::ALL
            .iter()
            .map(|&k| {
                let report = run(&SimConfig::new(k, 2 * SECOND, tenants.clone()));
                (k, report.longest_starvation.iter().copied().max().unwrap_or(0))
            })
            .collect();

        prop_assert!(longest.iter().all(|(_, l)| *l <= 500 * MS), "{:?}", longest);
    }

    /// Never Wait or Idle while an uncapped tenant has work, except BAND's bounded wait.
    #[test]
    fn work_conserving(tenants in arb_tenants()) {
        let stalls: Vec<(PolicyKind, Vec<sim::Stall>)> = PolicyKind::ALL
            .iter()
            .map(|&k| (k, run(&SimConfig::new(k, SECOND, tenants.clone())).stalls))
            .collect();
        let band_wait = SchedConfig::default().band_wait;
        let excused = |k: &PolicyKind, s: &sim::Stall| {
            *k == PolicyKind::Band && s.wait.is_some_and(|w| w <= band_wait)
        };

        prop_assert!(
            stalls.iter().all(|(k, ss)| ss.iter().all(|s| excused(k, s))),
            "{:?}", stalls
        );
    }

    /// Under WFQ nobody exceeds its weighted share of a 500 ms window by more than two
    /// longest kernels while the others wait. Fair queuing keeps a tenant's lag behind its
    /// share within about one kernel at any instant; a window's service is the difference
    /// of the lags at its two ends, hence two (one was too tight: a found case exceeded it
    /// by 0.1 ms, saved in proptest-regressions/).
    #[test]
    fn wfq_keeps_everyone_within_share_plus_two_kernels(tenants in arb_tenants()) {
        let window = 500 * MS;
        let report = run(&SimConfig::new(PolicyKind::Wfq, 4 * SECOND, tenants.clone()));
        let total: u64 = tenants.iter().map(|t| u64::from(t.params.weight)).sum();
        let longest = tenants.iter().flat_map(|t| t.kernels.iter().copied()).max().unwrap_or(0);
        let excess: Vec<i64> = report
            .device_ns(window)
            .iter()
            .flat_map(|row| {
                row.iter().zip(&tenants).map(|(&used, t)| {
                    let share = window * u64::from(t.params.weight) / total;
                    used as i64 - share as i64
                }).collect::<Vec<_>>()
            })
            .collect();

        prop_assert!(excess.iter().all(|&e| e <= 2 * longest as i64), "{:?} longest {}", excess, longest);
    }
}
