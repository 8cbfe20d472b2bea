//! The product page's "Example: two apps, one GPU", as a timeline under the paused clock.
//!
//! Default settings (window 2 s, drain 30 s); the fake GPU fits chat-a or chat-b, parks in 1 s
//! and wakes in 3 s.
#![allow(clippy::unwrap_used)]

mod coordinator_support;

use capyctl_interfaces::router::DrainReport;
use capyctl_spec::errors::ApiError;
use coordinator_support::*;

#[tokio::test(start_paused = true)]
async fn example_two_apps_one_gpu() {
    let r = rig().await;

    // App 1 is streaming answers from chat-a.
    let mut a1 = r.send(&r.a, hold(5.0));
    // 0 s: App 2 sends three requests for chat-b. They wait; one switch begins.
    let mut b: Vec<Req> = (0..3).map(|_| r.send(&r.b, hold(1.0))).collect();
    r.until(0.0).await;
    assert_eq!(a1.admitted_at(), secs(0.0));
    assert!(b.iter_mut().all(|q| q.waiting()));
    let plans = r.fake.plans();
    assert_eq!(plans.len(), 1, "one switch for the wave: {plans:?}");
    assert_eq!(r.since(plans[0].0), secs(0.0));
    assert_eq!(plans[0].1, B);

    // 0 to 2 s: chat-a still takes App 1's new requests (the admission window).
    r.until(1.0).await;
    let mut a2 = r.send(&r.a, hold(3.0));
    r.until(1.999).await;
    let mut a_late_in_window = r.send(&r.a, hold(0.5));
    r.until(1.9995).await;
    assert_eq!(a2.admitted_at(), secs(1.0));
    assert_eq!(a_late_in_window.admitted_at(), secs(1.999));

    // 2 s: chat-a takes no new requests and finishes the ones it is running: App 1's requests
    // that arrive now are answered 503.
    r.until(2.001).await;
    let mut a3 = r.send(&r.a, hold(1.0));
    r.until(2.5).await;
    let mut a3b = r.send(&r.a, hold(1.0));
    r.until(2.6).await;
    let (at, e) = a3.refused();
    assert_eq!(at, secs(2.001));
    assert_eq!(
        e,
        ApiError::DispatchClosed {
            deployment: A.into()
        }
    );
    assert_eq!(
        e.message(),
        format!("dispatch to deployment {A} is closed; retry shortly")
    );
    assert_eq!(e.status(), 503);
    assert_eq!(
        a3b.refused().1,
        ApiError::DispatchClosed {
            deployment: A.into()
        }
    );
    assert!(r.fake.executes().is_empty(), "still draining");

    // After the drain (App 1's stream ends at 5 s): chat-a parks, chat-b wakes.
    r.until(5.0).await;
    let ex = r.fake.executes();
    assert_eq!(ex.len(), 1);
    assert_eq!(r.since(ex[0].0), secs(5.0), "execute once the drain ends");
    assert_eq!(ex[0].1.target, B);
    assert_eq!(
        ex[0].1.victims,
        vec![(r.fake.key(A, 0), DrainReport::default())]
    );

    // Once chat-a has begun parking, App 1's requests wait instead and become the next switch.
    r.until(5.5).await;
    let mut a4 = r.send(&r.a, hold(1.0));
    // Any more for chat-b join the wave.
    r.until(7.0).await;
    let mut b4 = r.send(&r.b, hold(1.0));
    r.until(8.999).await;
    assert!(a4.waiting(), "waits, not 503, once parking began");
    assert!(b4.waiting());
    assert!(b.iter_mut().all(|q| q.waiting()));
    let load = r.h.load().await;
    let lb = load.iter().find(|l| l.deployment_id == B).unwrap();
    assert_eq!(lb.waiting, 4);
    let la = load.iter().find(|l| l.deployment_id == A).unwrap();
    assert_eq!(la.waiting, 1);

    // chat-b ready (5 + 1 park + 3 wake = 9 s): App 2's three requests, and the one more that
    // arrived, run together.
    r.until(9.0).await;
    for q in b.iter_mut() {
        assert_eq!(q.admitted_at(), secs(9.0));
    }
    assert_eq!(b4.admitted_at(), secs(9.0));

    // Next: App 1's waiting request begins the switch back, under the same rules.
    let plans = r.fake.plans();
    assert_eq!(plans.len(), 2, "{plans:?}");
    assert_eq!(r.since(plans[1].0), secs(9.0));
    assert_eq!(plans[1].1, A);
    assert!(plans[1].2.contains(A));
    // chat-b's own traffic does not extend its window: it closes at 11 s; nothing runs then.
    r.until(11.0).await;
    let ex = r.fake.executes();
    assert_eq!(ex.len(), 2);
    assert_eq!(r.since(ex[1].0), secs(11.0));
    assert_eq!(ex[1].1.target, A);
    assert_eq!(ex[1].1.victims[0].0, r.fake.key(B, 0));
    // chat-a ready at 11 + 1 + 3 = 15 s.
    r.until(15.0).await;
    assert_eq!(a4.admitted_at(), secs(15.0));
}
