//! `capyctl simulate --svg FILE`: the simulated timeline as an SVG picture, like the `/ui/`
//! page's: one row per model (per instance, `name #i`, for a model that ran several), engine
//! operations as coloured bars (start, park, wake, stop; their tooltip names the GPUs on a host
//! with several), its requests being served as a thin bar under them, and the requests waiting
//! in CapyCTL as a line below the rows. With `--compare`, one panel per value.

use std::collections::BTreeSet;
use std::fmt::Write;
use std::time::Duration;

use tokio::time::Instant;

use crate::simulate::{Run, instance_index};
use capyctl_node_agent::sim_host::OpKind;

const WIDTH: f64 = 1200.0;
const LABEL: f64 = 140.0;
const ROW: f64 = 26.0;
const WAITING: f64 = 70.0;
const AXIS: f64 = 24.0;
const TITLE: f64 = 24.0;

fn colour(kind: OpKind) -> &'static str {
    match kind {
        OpKind::Start => "#8e44ad",
        OpKind::Park => "#e67e22",
        OpKind::Wake => "#2980b9",
        OpKind::Stop => "#c0392b",
    }
}

/// Escapes text for SVG.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A tick step that gives about 10 ticks over `span`.
fn tick_step(span: Duration) -> Duration {
    let target = span.as_secs_f64() / 10.0;
    [
        0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1800.0,
        3600.0, 7200.0,
    ]
    .into_iter()
    .find(|s| *s >= target)
    .map_or(Duration::from_secs(14400), Duration::from_secs_f64)
}

fn label_of(t: Duration) -> String {
    let s = t.as_secs_f64();
    if s < 60.0 {
        format!("{s}s")
    } else if s < 3600.0 {
        format!("{}m{:02}s", (s / 60.0) as u64, (s % 60.0) as u64)
    } else {
        format!(
            "{}h{:02}m",
            (s / 3600.0) as u64,
            ((s % 3600.0) / 60.0) as u64
        )
    }
}

/// One row: its label, its model, and the instance it shows (`None`: the model's only one).
struct Row {
    label: String,
    model: String,
    instance: Option<u32>,
}

/// The rows of `run`: a model per row, or one per instance for a model that ran several.
fn rows(run: &Run) -> Vec<Row> {
    let mut rows = Vec::new();
    for name in run.model_names() {
        let instances: BTreeSet<u32> = run
            .ops
            .iter()
            .filter(|o| o.model == name)
            .map(instance_index)
            .chain(
                run.requests
                    .iter()
                    .filter(|r| r.model == name)
                    .filter_map(|r| r.instance),
            )
            .collect();
        if instances.iter().any(|i| *i != 0) {
            rows.extend(instances.into_iter().map(|i| Row {
                label: format!("{name} #{i}"),
                model: name.clone(),
                instance: Some(i),
            }));
        } else {
            rows.push(Row {
                label: name.clone(),
                model: name,
                instance: None,
            });
        }
    }
    rows
}

fn panel(out: &mut String, top: f64, title: &str, run: &Run) -> f64 {
    let span = run
        .end
        .saturating_duration_since(run.t0)
        .max(Duration::from_millis(1));
    let plot = WIDTH - LABEL - 10.0;
    let x = |at: Instant| {
        LABEL + plot * at.saturating_duration_since(run.t0).as_secs_f64() / span.as_secs_f64()
    };
    let rows = rows(run);
    let _ = writeln!(
        out,
        r#"<text x="4" y="{:.1}" font-weight="bold">{}</text>"#,
        top + 16.0,
        esc(title)
    );
    let rows_top = top + TITLE;
    for (i, row) in rows.iter().enumerate() {
        let y = rows_top + i as f64 * ROW;
        let shown = |model: &str, instance: Option<u32>| {
            model == row.model && (row.instance.is_none() || instance == row.instance)
        };
        let _ = writeln!(
            out,
            r##"<rect x="{LABEL}" y="{y:.1}" width="{plot:.1}" height="{:.1}" fill="#f4f4f4"/><text x="4" y="{:.1}">{}</text>"##,
            ROW - 4.0,
            y + ROW / 2.0 + 4.0,
            esc(&row.label)
        );
        // Serving: a green band at the bottom of the row.
        for r in run.requests.iter().filter(|r| shown(&r.model, r.instance)) {
            if let Some(a) = r.admitted {
                let (x0, x1) = (x(a), x(r.ended));
                let _ = writeln!(
                    out,
                    r##"<rect x="{x0:.2}" y="{:.1}" width="{:.2}" height="6" fill="#27ae60" fill-opacity="0.5"/>"##,
                    y + ROW - 10.0,
                    (x1 - x0).max(0.5)
                );
            }
        }
        for o in run
            .ops
            .iter()
            .filter(|o| shown(&o.model, Some(instance_index(o))))
        {
            let (x0, x1) = (x(o.began.max(run.t0)), x(o.ended));
            let took = o.ended.saturating_duration_since(o.began);
            let on = if run.gpu_count > 1 {
                let gpus: Vec<String> = o.gpus.iter().map(u32::to_string).collect();
                format!(" on GPU {}", gpus.join(","))
            } else {
                String::new()
            };
            let _ = writeln!(
                out,
                r#"<rect x="{x0:.2}" y="{:.1}" width="{:.2}" height="{:.1}" fill="{}"><title>{} {}{}: {:.2} s</title></rect>"#,
                y + 2.0,
                (x1 - x0).max(1.0),
                ROW - 14.0,
                colour(o.kind),
                esc(&row.label),
                o.kind.name(),
                on,
                took.as_secs_f64()
            );
        }
    }
    // Waiting requests: a step line.
    let wait_top = rows_top + rows.len() as f64 * ROW + 6.0;
    let mut events: Vec<(Instant, i64)> = Vec::new();
    for r in &run.requests {
        events.push((r.arrival, 1));
        events.push((r.admitted.unwrap_or(r.ended), -1));
    }
    events.sort_by_key(|e| (e.0, e.1));
    let mut level = 0i64;
    let mut steps: Vec<(Instant, i64)> = vec![(run.t0, 0)];
    for (at, d) in events {
        level += d;
        steps.push((at, level));
    }
    let most = steps.iter().map(|s| s.1).max().unwrap_or(0).max(1);
    let yv = |v: i64| wait_top + WAITING - 4.0 - (WAITING - 14.0) * v as f64 / most as f64;
    let mut path = format!("M{:.2},{:.2}", x(run.t0), yv(0));
    let mut last = 0;
    for (at, v) in &steps {
        let _ = write!(
            path,
            " L{:.2},{:.2} L{:.2},{:.2}",
            x(*at),
            yv(last),
            x(*at),
            yv(*v)
        );
        last = *v;
    }
    let _ = write!(path, " L{:.2},{:.2}", x(run.end), yv(last));
    let _ = writeln!(
        out,
        r##"<rect x="{LABEL}" y="{wait_top:.1}" width="{plot:.1}" height="{WAITING}" fill="#fbfbfb" stroke="#ddd"/><text x="4" y="{:.1}">waiting (max {most})</text><path d="{path}" fill="none" stroke="#d35400" stroke-width="1.5"/>"##,
        wait_top + WAITING / 2.0
    );
    // The time axis.
    let axis_y = wait_top + WAITING + 14.0;
    let step = tick_step(span);
    let mut t = Duration::ZERO;
    while t <= span {
        let xt = LABEL + plot * t.as_secs_f64() / span.as_secs_f64();
        let _ = writeln!(
            out,
            r##"<line x1="{xt:.1}" y1="{rows_top:.1}" x2="{xt:.1}" y2="{:.1}" stroke="#ccc" stroke-width="0.5"/><text x="{xt:.1}" y="{axis_y:.1}" text-anchor="middle" font-size="10">{}</text>"##,
            wait_top + WAITING,
            label_of(t)
        );
        t += step;
    }
    axis_y + AXIS - top
}

/// The SVG of `runs` (one panel each).
pub fn render(runs: &[(Option<String>, Run)]) -> String {
    let mut body = String::new();
    let mut top = 30.0;
    for (setting, run) in runs {
        let title = setting
            .clone()
            .unwrap_or_else(|| "simulated timeline".to_string());
        top += panel(&mut body, top, &title, run);
    }
    let mut legend = String::new();
    let mut lx = LABEL;
    for (name, fill) in [
        ("start", colour(OpKind::Start)),
        ("park", colour(OpKind::Park)),
        ("wake", colour(OpKind::Wake)),
        ("stop", colour(OpKind::Stop)),
        ("serving", "#27ae60"),
        ("waiting requests", "#d35400"),
    ] {
        let _ = write!(
            legend,
            r#"<rect x="{lx:.0}" y="8" width="12" height="12" fill="{fill}"/><text x="{:.0}" y="18">{name}</text>"#,
            lx + 16.0
        );
        lx += 30.0 + 8.0 * name.len() as f64;
    }
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{top:.0}\" viewBox=\"0 0 {WIDTH} {top:.0}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n{legend}\n{body}</svg>\n"
    )
}
