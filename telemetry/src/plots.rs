//! Training curves as one PNG per run: a grid of panels (loss, perplexity, learning rate, reward,
//! KL, clip fraction, ...), each drawn when the run's `metrics.jsonl` has its metrics, against the
//! step (pretraining: the iteration). The same records and steps as the TensorBoard scalars
//! ([`crate::tensorboard::scalars_of_records`]), so the two never disagree.

use crate::tensorboard::scalars_of_records;
use anyhow::{anyhow, Context, Result};
use plotters::prelude::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The file every run's curves go to, beside its `metrics.jsonl`.
pub const CURVES_FILE: &str = "curves.png";
pub const PANEL_WIDTH: u32 = 640;
pub const PANEL_HEIGHT: u32 = 400;
const COLUMNS: u32 = 2;

/// One panel: a title, the y axis' label and scale, and the metrics drawn in it, each `(tag,
/// legend)`; a metric the run does not have is left out, a panel with none is not drawn.
struct Panel {
    title: &'static str,
    y_label: &'static str,
    log_y: bool,
    /// Not drawn when every value is the same (the loss scale of a run without fp16).
    hide_when_constant: bool,
    /// A noisy metric (a loss, a rollout's reward): long series are smoothed.
    smooth: bool,
    series: &'static [(&'static str, &'static str)],
}

/// A noisy metric's panel.
const fn panel(title: &'static str, y_label: &'static str, series: &'static [(&'static str, &'static str)]) -> Panel {
    Panel { title, y_label, log_y: false, hide_when_constant: false, smooth: true, series }
}

/// A panel of values that are exact as they are (a schedule, an evaluation, a rate).
const fn exact(title: &'static str, y_label: &'static str, series: &'static [(&'static str, &'static str)]) -> Panel {
    Panel { smooth: false, ..panel(title, y_label, series) }
}

/// Series longer than this are drawn twice: the raw values faintly, and under TensorBoard's
/// smoothing (an exponential moving average, weight 0.9) in full colour, so a trend shows
/// through rollout-to-rollout noise.
const SMOOTH_FROM: usize = 40;
const SMOOTHING: f64 = 0.9;

/// Every panel any step or pretraining can have, in the order they are laid out.
const PANELS: &[Panel] = &[
    // Pretraining (Megatron's names in our records).
    panel("LM loss", "cross-entropy (nats)", &[("lm_loss", "train"), ("valid_loss", "validation")]),
    // Steps 1 and 2, DPO.
    panel("Loss", "loss", &[("loss", "train"), ("eval_loss", "held-out"), ("eval/loss", "held-out")]),
    Panel {
        title: "Perplexity",
        y_label: "perplexity (log scale)",
        log_y: true,
        hide_when_constant: false,
        smooth: false,
        series: &[("eval_ppl", "held-out")],
    },
    exact(
        "Reward accuracy",
        "share of pairs ranked right",
        &[("eval/accuracy", "held-out pairs"), ("eval/reward_accuracy", "held-out pairs (implicit reward)")],
    ),
    exact(
        "Reward margin",
        "chosen - rejected",
        &[("eval/margin_quantiles/q50", "median, held-out pairs"), ("eval/reward_margin", "mean, held-out pairs")],
    ),
    // Step 3.
    panel("Reward", "reward-model score", &[("rollout/reward_mean", "rollout mean")]),
    panel("KL to the reference", "nats per token", &[("rollout/kl_ref_k3", "k3 estimate")]),
    panel(
        "Clip fraction",
        "share of tokens clipped",
        &[("clip_fraction", "all updates"), ("clip_fraction_after_first", "after a phase's first")],
    ),
    panel("Entropy", "nats per token", &[("entropy", "actor")]),
    panel("Answer length", "tokens", &[("rollout/answer_len_mean", "rollout mean")]),
    panel("Actor loss", "loss", &[("actor_loss", "")]),
    // (GRPO and RLOO have no critic, hence no panel.)
    panel("Critic loss", "loss", &[("critic_loss", "")]),
    // Every run.
    exact("Learning rate", "learning rate", &[("lr", ""), ("actor_lr", "actor"), ("critic_lr", "critic")]),
    Panel {
        title: "Loss scale",
        y_label: "loss scale (log scale)",
        log_y: true,
        hide_when_constant: true,
        smooth: false,
        series: &[("loss_scale", ""), ("actor_loss_scale", "actor"), ("critic_loss_scale", "critic")],
    },
    exact("Throughput", "per second", &[("tokens_per_sec", "tokens"), ("pairs_per_sec", "pairs")]),
];

/// One curve of a panel: its legend and its (step, value) points.
type Series<'a> = (&'a str, &'a Vec<(f64, f64)>);

/// What [`plot_records`] drew.
#[derive(Debug)]
pub struct Plotted {
    pub path: PathBuf,
    pub panels: Vec<&'static str>,
    pub size: (u32, u32),
}

static FONT: &[u8] = include_bytes!("../../assets/fonts/DejaVuSansMono.ttf");

fn register_font() -> Result<()> {
    static REGISTERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| plotters::style::register_font("sans-serif", FontStyle::Normal, FONT).is_ok());
    ok.then_some(()).ok_or_else(|| anyhow!("the embedded plot font does not load"))
}

/// Draws the curves of a run's `metrics.jsonl` records into `out` (a PNG of [`COLUMNS`] panels
/// per row); `None` when the records hold none of the panels' metrics.
pub fn plot_records(records: &[serde_json::Value], out: &Path) -> Result<Option<Plotted>> {
    let mut by_tag: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for (step, tag, value) in scalars_of_records(records, &[], 0) {
        if value.is_finite() {
            by_tag.entry(tag).or_default().push((step as f64, f64::from(value)));
        }
    }
    let x_label = if records.iter().any(|r| r.get("iteration").is_some()) { "iteration" } else { "step" };
    let drawn: Vec<(&Panel, Vec<Series>)> = PANELS
        .iter()
        .map(|p| {
            let series = p
                .series
                .iter()
                .filter_map(|(tag, legend)| Some((*legend, by_tag.get(*tag)?)))
                .filter(|(_, points)| !p.log_y || points.iter().all(|(_, y)| *y > 0.0))
                .collect::<Vec<_>>();
            (p, series)
        })
        .filter(|(p, series)| {
            let mut values = series.iter().flat_map(|(_, points)| points.iter().map(|(_, y)| *y));
            let first = values.next();
            first.is_some() && !(p.hide_when_constant && values.all(|y| Some(y) == first))
        })
        .collect();
    if drawn.is_empty() {
        return Ok(None);
    }
    register_font()?;
    let rows = (drawn.len() as u32).div_ceil(COLUMNS);
    let size = (PANEL_WIDTH * COLUMNS, PANEL_HEIGHT * rows);
    let root = BitMapBackend::new(out, size).into_drawing_area();
    root.fill(&WHITE).map_err(plot_error)?;
    let areas = root.split_evenly((rows as usize, COLUMNS as usize));
    for (area, (panel, series)) in areas.iter().zip(&drawn) {
        draw_panel(area, panel, series, x_label)?;
    }
    root.present().map_err(plot_error).with_context(|| format!("cannot write {}", out.display()))?;
    Ok(Some(Plotted { path: out.to_path_buf(), panels: drawn.iter().map(|(p, _)| p.title).collect(), size }))
}

fn plot_error<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing the curves: {e:?}")
}

/// The range of `values` with a margin, never empty.
fn padded_range(values: impl Iterator<Item = f64>, log: bool) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if log {
        return (lo / 1.5, hi * 1.5);
    }
    let pad = if hi > lo { 0.05 * (hi - lo) } else { 0.5 * lo.abs().max(1e-3) };
    (lo - pad, hi + pad)
}

fn draw_panel(
    area: &DrawingArea<BitMapBackend, plotters::coord::Shift>,
    panel: &Panel,
    series: &[Series],
    x_label: &str,
) -> Result<()> {
    let (x0, x1) = padded_range(series.iter().flat_map(|(_, p)| p.iter().map(|(x, _)| *x)), false);
    let (y0, y1) = padded_range(series.iter().flat_map(|(_, p)| p.iter().map(|(_, y)| *y)), panel.log_y);
    let mut builder = ChartBuilder::on(area);
    builder.caption(panel.title, ("sans-serif", 22)).margin(12).x_label_area_size(44).y_label_area_size(84);
    // The two y scales are two chart types: one body, instantiated for each.
    macro_rules! draw {
        ($y_range:expr) => {{
            let mut chart = builder.build_cartesian_2d(x0..x1, $y_range).map_err(plot_error)?;
            chart
                .configure_mesh()
                .x_desc(x_label)
                .y_desc(panel.y_label)
                .label_style(("sans-serif", 14))
                .axis_desc_style(("sans-serif", 16))
                .y_label_formatter(&|y| format_tick(*y))
                .x_label_formatter(&|x| format!("{x:.0}"))
                .draw()
                .map_err(plot_error)?;
            for (i, (legend, points)) in series.iter().enumerate() {
                let color = Palette99::pick(i).to_rgba();
                let style = ShapeStyle { color, filled: false, stroke_width: 2 };
                let drawn = if points.len() == 1 {
                    chart.draw_series(points.iter().map(|p| Circle::new(*p, 4, style.filled()))).map_err(plot_error)?
                } else if panel.smooth && points.len() >= SMOOTH_FROM {
                    let faint = ShapeStyle { color: color.mix(0.25), filled: false, stroke_width: 1 };
                    chart.draw_series(LineSeries::new(points.iter().copied(), faint)).map_err(plot_error)?;
                    chart.draw_series(LineSeries::new(smoothed(points), style)).map_err(plot_error)?
                } else {
                    chart.draw_series(LineSeries::new(points.iter().copied(), style)).map_err(plot_error)?
                };
                if !legend.is_empty() {
                    drawn.label(*legend).legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
                }
            }
            if series.iter().any(|(legend, _)| !legend.is_empty()) {
                chart
                    .configure_series_labels()
                    .label_font(("sans-serif", 14))
                    .background_style(WHITE.mix(0.8))
                    .border_style(BLACK)
                    .draw()
                    .map_err(plot_error)?;
            }
        }};
    }
    if panel.log_y {
        draw!((y0..y1).log_scale());
    } else {
        draw!(y0..y1);
    }
    Ok(())
}

/// TensorBoard's smoothing: an exponential moving average, debiased at the start (as its
/// scalars dashboard does), so the first points are not pulled toward zero.
fn smoothed(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let mut average = 0.0;
    let mut weight = 0.0;
    points
        .iter()
        .map(|&(x, y)| {
            average = SMOOTHING * average + (1.0 - SMOOTHING) * y;
            weight = SMOOTHING * weight + (1.0 - SMOOTHING);
            (x, average / weight)
        })
        .collect()
}

/// A tick label short enough for the axis: 3 significant digits, scientific when far from 1.
fn format_tick(y: f64) -> String {
    let a = y.abs();
    if a != 0.0 && !(1e-2..1e5).contains(&a) {
        format!("{y:.1e}")
    } else {
        let s = format!("{y:.3}");
        let s = s.trim_end_matches('0').trim_end_matches('.');
        if s == "-0" {
            "0".into()
        } else {
            s.to_string()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Reads a PNG's width and height from its IHDR chunk.
    fn png_size(bytes: &[u8]) -> (u32, u32) {
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "a PNG signature");
        assert_eq!(&bytes[12..16], b"IHDR");
        let be = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap());
        (be(16), be(20))
    }

    #[test]
    fn a_ppo_run_gets_its_panels_in_a_png_of_the_grid_size() {
        let records: Vec<serde_json::Value> = (1..=20)
            .map(|s| {
                let s = s as f64;
                json!({"step": s as i64, "actor_loss": 1.0 / s, "critic_loss": 2.0 / s, "clip_fraction": 0.01 * s,
                   "entropy": 1.0 - 0.01 * s, "actor_lr": 1e-4, "critic_lr": 5e-4,
                   "actor_loss_scale": if s < 10.0 { 65536.0 } else { 32768.0 },
                   "rollout": {"reward_mean": s.ln(), "kl_ref_k3": 0.01 * s, "answer_len_mean": 7.0}})
            })
            .chain([json!({"event": "end", "summary": {"steps": 20}})])
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join(CURVES_FILE);
        let plotted = plot_records(&records, &out).unwrap().unwrap();
        let want = [
            "Reward",
            "KL to the reference",
            "Clip fraction",
            "Entropy",
            "Answer length",
            "Actor loss",
            "Critic loss",
            "Learning rate",
            "Loss scale",
        ];
        assert_eq!(plotted.panels, want);
        let bytes = std::fs::read(&out).unwrap();
        assert_eq!(png_size(&bytes), (2 * PANEL_WIDTH, 5 * PANEL_HEIGHT));
        assert_eq!(plotted.size, (2 * PANEL_WIDTH, 5 * PANEL_HEIGHT));
        // Not a blank canvas: drawn lines and text make many distinct bytes after compression.
        assert!(bytes.len() > 20_000, "{} bytes", bytes.len());
    }

    #[test]
    fn sft_gets_loss_and_perplexity_and_nothing_plottable_draws_nothing() {
        let mut records = vec![json!({"epoch": 0, "eval_loss": 10.9, "eval_ppl": 54000.0})];
        records.extend((1..=10).map(|s| json!({"step": s, "epoch": 1, "loss": 10.0 - s as f64, "lr": 1e-3})));
        records.push(json!({"epoch": 1, "eval_loss": 0.4, "eval_ppl": 1.5}));
        let dir = tempfile::tempdir().unwrap();
        let plotted = plot_records(&records, &dir.path().join("sft.png")).unwrap().unwrap();
        assert_eq!(plotted.panels, ["Loss", "Perplexity", "Learning rate"]);
        assert_eq!(png_size(&std::fs::read(dir.path().join("sft.png")).unwrap()), (2 * PANEL_WIDTH, 2 * PANEL_HEIGHT));
        assert!(plot_records(&[json!({"event": "end"})], &dir.path().join("none.png")).unwrap().is_none());
        // A loss scale that never moves (no fp16) is not worth a panel.
        records.push(json!({"step": 11, "loss": 0.5, "loss_scale": 1.0}));
        let plotted = plot_records(&records, &dir.path().join("sft.png")).unwrap().unwrap();
        assert_eq!(plotted.panels, ["Loss", "Perplexity", "Learning rate"]);
        assert!(!dir.path().join("none.png").exists());
    }

    #[test]
    fn smoothing_is_a_debiased_moving_average() {
        let s = smoothed(&[(1.0, 2.0), (2.0, 2.0), (3.0, 4.0)]);
        assert_eq!(s[0], (1.0, 2.0));
        assert!((s[1].1 - 2.0).abs() < 1e-12);
        // (0.9 * 0.19 * 2 + 0.1 * 4) / 0.271: the last value weighs 0.1 / 0.271 of the average.
        assert!((s[2].1 - (0.9 * 0.19 * 2.0 + 0.4) / 0.271).abs() < 1e-12, "{s:?}");
    }

    #[test]
    fn ticks_are_short() {
        assert_eq!(format_tick(0.000123), "1.2e-4");
        assert_eq!(format_tick(0.5), "0.5");
        assert_eq!(format_tick(2.0), "2");
        assert_eq!(format_tick(12345.678), "12345.678");
        assert_eq!(format_tick(-0.0001), "-1.0e-4");
        assert_eq!(format_tick(0.0), "0");
    }
}
