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
    scale: Scale,
    /// Not drawn when every value is the same (the loss scale of a run without fp16).
    hide_when_constant: bool,
    /// A noisy metric (a loss, a rollout's reward): long series are smoothed.
    smooth: bool,
    series: &'static [(&'static str, &'static str)],
}

/// The y axis of a panel.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Scale {
    Linear,
    Log,
    /// Logarithmic where every value is positive and the largest is at least [`DECADES`] times the
    /// smallest (a loss falling from 11 to 0.1 would leave everything after its first steps
    /// squashed at the bottom of a linear axis), else linear.
    LogWhenSpanningDecades,
}

const DECADES: f64 = 100.0;

impl Scale {
    /// Whether a panel of `values` is drawn on a log axis.
    fn is_log(self, values: impl Iterator<Item = f64>) -> bool {
        match self {
            Self::Linear => false,
            Self::Log => true,
            Self::LogWhenSpanningDecades => {
                let (lo, hi) = values.fold((f64::INFINITY, 0f64), |(lo, hi), y| (lo.min(y), hi.max(y)));
                lo > 0.0 && hi >= DECADES * lo
            }
        }
    }
}

/// A noisy metric's panel.
const fn panel(title: &'static str, y_label: &'static str, series: &'static [(&'static str, &'static str)]) -> Panel {
    Panel { title, y_label, scale: Scale::Linear, hide_when_constant: false, smooth: true, series }
}

/// A loss's panel: noisy, on a log axis where it spans decades.
const fn loss(title: &'static str, y_label: &'static str, series: &'static [(&'static str, &'static str)]) -> Panel {
    Panel { scale: Scale::LogWhenSpanningDecades, ..panel(title, y_label, series) }
}

/// A panel of values that are exact as they are (a schedule, an evaluation, a rate).
const fn exact(title: &'static str, y_label: &'static str, series: &'static [(&'static str, &'static str)]) -> Panel {
    Panel { smooth: false, ..panel(title, y_label, series) }
}

/// Series longer than this are drawn twice: the raw values as a faint band (their lowest and
/// highest in each of [`BANDS`] slices of the steps), and under TensorBoard's smoothing (an
/// exponential moving average, weight 0.9) in full colour, so a trend shows through
/// rollout-to-rollout noise. (The raw values as a faint line were a scribble that made a PPO
/// grid's PNG weigh up to a megabyte.)
const SMOOTH_FROM: usize = 40;
const SMOOTHING: f64 = 0.9;
const BANDS: usize = 160;

/// Every panel any step or pretraining can have, in the order they are laid out.
const PANELS: &[Panel] = &[
    // Pretraining (Megatron's names in our records).
    loss("LM loss", "cross-entropy (nats)", &[("lm_loss", "train"), ("valid_loss", "validation")]),
    // Steps 1 and 2, DPO.
    loss("Loss", "loss", &[("loss", "train"), ("eval_loss", "held-out"), ("eval/loss", "held-out")]),
    Panel {
        title: "Perplexity",
        y_label: "perplexity",
        scale: Scale::Log,
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
    loss("Actor loss", "loss", &[("actor_loss", "")]),
    // (GRPO and RLOO have no critic, hence no panel.)
    loss("Critic loss", "loss", &[("critic_loss", "")]),
    // Every run.
    exact("Learning rate", "learning rate", &[("lr", ""), ("actor_lr", "actor"), ("critic_lr", "critic")]),
    Panel {
        title: "Loss scale",
        y_label: "loss scale",
        scale: Scale::Log,
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
                .filter(|(_, points)| p.scale != Scale::Log || points.iter().all(|(_, y)| *y > 0.0))
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
    let mut pixels = vec![0u8; size.0 as usize * size.1 as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut pixels, size).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        let areas = root.split_evenly((rows as usize, COLUMNS as usize));
        for (area, (panel, series)) in areas.iter().zip(&drawn) {
            draw_panel(area, panel, series, x_label)?;
        }
        root.present().map_err(plot_error)?;
    }
    let png = encode_png(&pixels, size)?;
    durable::write_file_atomically(out, &png).with_context(|| format!("cannot write {}", out.display()))?;
    Ok(Some(Plotted { path: out.to_path_buf(), panels: drawn.iter().map(|(p, _)| p.title).collect(), size }))
}

/// RGB pixels as a PNG compressed as tightly as the encoder can (adaptive filters, the best
/// deflate level): a few hundred kilobytes for the largest grid, where the bitmap backend's own
/// fast encoding wrote up to a megabyte.
fn encode_png(pixels: &[u8], (width, height): (u32, u32)) -> Result<Vec<u8>> {
    let mut png = Vec::new();
    let mut encoder = png::Encoder::new(&mut png, width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder.set_compression(png::Compression::Best);
    encoder.set_adaptive_filter(png::AdaptiveFilterType::Adaptive);
    let mut writer = encoder.write_header().map_err(plot_error)?;
    writer.write_image_data(pixels).map_err(plot_error)?;
    writer.finish().map_err(plot_error)?;
    Ok(png)
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
    let values = || series.iter().flat_map(|(_, p)| p.iter().map(|(_, y)| *y));
    let log = panel.scale.is_log(values());
    let (x0, x1) = padded_range(series.iter().flat_map(|(_, p)| p.iter().map(|(x, _)| *x)), false);
    let (y0, y1) = padded_range(values(), log);
    let y_label = if log { format!("{} (log scale)", panel.y_label) } else { panel.y_label.to_string() };
    let legend_at = legend_place(series, (x0, x1), (y0, y1), log);
    let mut builder = ChartBuilder::on(area);
    builder.caption(panel.title, ("sans-serif", 22)).margin(12).x_label_area_size(44).y_label_area_size(84);
    // The two y scales are two chart types: one body, instantiated for each.
    macro_rules! draw {
        ($y_range:expr) => {{
            let mut chart = builder.build_cartesian_2d(x0..x1, $y_range).map_err(plot_error)?;
            chart
                .configure_mesh()
                .x_desc(x_label)
                .y_desc(&y_label)
                .label_style(("sans-serif", 14))
                .axis_desc_style(("sans-serif", 16))
                .y_label_formatter(&|y| format_tick(*y, y1 - y0))
                .x_label_formatter(&|x| format!("{x:.0}"))
                .draw()
                .map_err(plot_error)?;
            for (i, (legend, points)) in series.iter().enumerate() {
                let color = Palette99::pick(i).to_rgba();
                let style = ShapeStyle { color, filled: false, stroke_width: 2 };
                let drawn = if points.len() == 1 {
                    chart.draw_series(points.iter().map(|p| Circle::new(*p, 4, style.filled()))).map_err(plot_error)?
                } else if panel.smooth && points.len() >= SMOOTH_FROM {
                    let band = ShapeStyle { color: color.mix(0.2), filled: true, stroke_width: 0 };
                    chart
                        .draw_series(std::iter::once(Polygon::new(envelope(points, BANDS), band)))
                        .map_err(plot_error)?;
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
                    .position(legend_at.clone())
                    .label_font(("sans-serif", 14))
                    .background_style(WHITE.mix(0.8))
                    .border_style(BLACK)
                    .draw()
                    .map_err(plot_error)?;
            }
        }};
    }
    if log {
        draw!((y0..y1).log_scale());
    } else {
        draw!(y0..y1);
    }
    Ok(())
}

/// The band around `points` (sorted by step): their highest value in each of `slices` equal
/// slices of the steps, left to right, then their lowest, right to left, as one polygon.
fn envelope(points: &[(f64, f64)], slices: usize) -> Vec<(f64, f64)> {
    let (first, last) = (points[0].0, points[points.len() - 1].0);
    let width = (last - first).max(f64::MIN_POSITIVE) / slices as f64;
    let mut bands: Vec<(f64, f64, f64)> = Vec::new(); // (step, low, high)
    for &(x, y) in points {
        let slice = (((x - first) / width) as usize).min(slices - 1);
        let at = first + (slice as f64 + 0.5) * width;
        match bands.last_mut() {
            Some(band) if band.0 == at => (band.1, band.2) = (band.1.min(y), band.2.max(y)),
            _ => bands.push((at, y, y)),
        }
    }
    let upper = bands.iter().map(|&(x, _, high)| (x, high));
    upper.chain(bands.iter().rev().map(|&(x, low, _)| (x, low))).collect()
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

/// A tick label short enough for the axis: 3 significant digits, scientific when far from 1; a
/// value within a billionth of the axis' `span` of zero is 0 (the ticks' arithmetic leaves such
/// remainders, e.g. -2.8e-17).
fn format_tick(y: f64, span: f64) -> String {
    let a = y.abs();
    if a <= 1e-9 * span.abs() {
        return "0".into();
    }
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

/// The place in a panel where the legend covers the fewest of its points: a corner, else the
/// middle of a side. Each place's box (two fifths of the width, an eighth of the height per
/// legend line, as the legend takes) is counted in the axes' coordinates (the logarithm's on a
/// log axis).
fn legend_place(series: &[Series], (x0, x1): (f64, f64), (y0, y1): (f64, f64), log: bool) -> SeriesLabelPosition {
    use SeriesLabelPosition::{LowerLeft, LowerRight, MiddleLeft, MiddleRight, UpperLeft, UpperRight};
    let scaled = |y: f64| if log { y.max(f64::MIN_POSITIVE).ln() } else { y };
    let (ylo, yhi) = (scaled(y0), scaled(y1));
    let height = (0.12 * series.len() as f64).min(0.5);
    // (place, on the right, its vertical band in [0, 1] from the bottom)
    let places = [
        (UpperRight, true, (1.0 - height, 1.0)),
        (UpperLeft, false, (1.0 - height, 1.0)),
        (LowerRight, true, (0.0, height)),
        (LowerLeft, false, (0.0, height)),
        (MiddleRight, true, (0.5 - height / 2.0, 0.5 + height / 2.0)),
        (MiddleLeft, false, (0.5 - height / 2.0, 0.5 + height / 2.0)),
    ];
    let covered = |&(_, right, (bottom, top)): &(SeriesLabelPosition, bool, (f64, f64))| {
        let points = series.iter().flat_map(|(_, p)| p.iter());
        points
            .filter(|&&(x, y)| {
                let (u, v) = ((x - x0) / (x1 - x0), (scaled(y) - ylo) / (yhi - ylo));
                (if right { u >= 0.6 } else { u <= 0.4 }) && (bottom..=top).contains(&v)
            })
            .count()
    };
    // The first of the least covered, in the order above (upper right when there is a tie).
    places.iter().min_by_key(|p| covered(p)).map_or(UpperRight, |p| p.0.clone())
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

    /// An SFT run as the demo's: 600 noisy steps whose loss falls from 11 to 0.1, held-out
    /// evaluations, a schedule.
    fn long_sft_run() -> Vec<serde_json::Value> {
        let mut records = vec![json!({"epoch": 0, "eval_loss": 10.9, "eval_ppl": 54000.0})];
        let mut noise = 0x2545_f491_4f6c_dd1du64;
        for s in 1..=600u64 {
            noise ^= noise << 13;
            noise ^= noise >> 7;
            noise ^= noise << 17;
            let jitter = 1.0 + 0.3 * ((noise % 1000) as f64 / 1000.0 - 0.5);
            let loss = 0.1 + 10.9 * (-(s as f64) / 40.0).exp();
            let lr = 1e-3 * (1.0 - s as f64 / 600.0);
            records.push(json!({"step": s, "epoch": 1 + s / 200, "loss": loss * jitter, "lr": lr}));
            if s % 200 == 0 {
                records.push(json!({"epoch": s / 200, "eval_loss": loss, "eval_ppl": loss.exp()}));
            }
        }
        records
    }

    /// A PPO run of 300 noisy rollouts: every step-3 panel, five rows.
    fn long_ppo_run() -> Vec<serde_json::Value> {
        let mut noise = 0x9e37_79b9_7f4a_7c15u64;
        let mut jitter = move || {
            noise ^= noise << 13;
            noise ^= noise >> 7;
            noise ^= noise << 17;
            (noise % 1000) as f64 / 1000.0 - 0.5
        };
        (1..=300)
            .map(|s| {
                let s = s as f64;
                json!({"step": s as i64, "actor_loss": jitter() / s.sqrt(), "critic_loss": (1.0 + jitter()) / s,
                   "clip_fraction": 0.05 + 0.02 * jitter(), "clip_fraction_after_first": 0.03 + 0.01 * jitter(),
                   "entropy": 2.0 - s / 300.0 + 0.1 * jitter(), "actor_lr": 1e-5, "critic_lr": 5e-6,
                   "rollout": {"reward_mean": (s / 30.0).ln_1p() + jitter(), "kl_ref_k3": 0.001 * s * (1.0 + jitter()),
                               "answer_len_mean": 20.0 + 5.0 * jitter()}})
            })
            .collect()
    }

    #[test]
    fn long_runs_plot_in_under_300_kb() {
        let dir = tempfile::tempdir().unwrap();
        for (name, records) in [("sft", long_sft_run()), ("ppo", long_ppo_run())] {
            let out = dir.path().join(format!("{name}.png"));
            plot_records(&records, &out).unwrap().unwrap();
            let bytes = std::fs::metadata(&out).unwrap().len();
            assert!(bytes < 300 * 1024, "{name}: {bytes} bytes");
        }
    }

    #[test]
    fn a_loss_spanning_decades_is_drawn_on_a_log_axis() {
        let auto = Scale::LogWhenSpanningDecades;
        assert!(auto.is_log([11.0, 2.0, 0.1].into_iter()));
        assert!(!auto.is_log([11.0, 2.0, 0.2].into_iter()), "under two decades");
        assert!(!auto.is_log([1.0, -0.5, 0.001].into_iter()), "a value below zero");
        assert!(Scale::Log.is_log([1.0].into_iter()) && !Scale::Linear.is_log([1e6, 1e-6].into_iter()));
    }

    #[test]
    fn the_legend_goes_where_the_curves_are_not() {
        // Falling from the upper left to the lower right: the upper right and the lower left are
        // free, and the upper right comes first.
        let falling: Vec<(f64, f64)> = (0..100).map(|i| (i as f64, 100.0 - i as f64)).collect();
        let series = [("train", &falling)];
        assert_eq!(
            format!("{:?}", legend_place(&series, (0.0, 99.0), (0.0, 100.0), false)),
            format!("{:?}", SeriesLabelPosition::UpperRight)
        );
        // Rising and flat at the top: only the lower right is free.
        let rising: Vec<(f64, f64)> = (0..100).map(|i| (i as f64, i as f64)).collect();
        let top: Vec<(f64, f64)> = (0..100).map(|i| (i as f64, 100.0)).collect();
        let series = [("a", &rising), ("b", &top)];
        assert_eq!(
            format!("{:?}", legend_place(&series, (0.0, 99.0), (0.0, 100.0), false)),
            format!("{:?}", SeriesLabelPosition::LowerRight)
        );
        // Flat at the top and at the bottom (two learning rates): the middle of the right side.
        let bottom: Vec<(f64, f64)> = (0..100).map(|i| (i as f64, 0.0)).collect();
        let series = [("actor", &top), ("critic", &bottom)];
        assert_eq!(
            format!("{:?}", legend_place(&series, (0.0, 99.0), (-5.0, 105.0), false)),
            format!("{:?}", SeriesLabelPosition::MiddleRight)
        );
    }

    #[test]
    fn the_band_is_each_slices_lowest_and_highest() {
        // Steps 0..=9 in 2 slices, 0..4.5 and 4.5..9, centred at 2.25 and 6.75; values 1, 0, 3,
        // 2, 5 in the first (0 to 5), 4, 7, 6, 9, 8 in the second (4 to 9).
        let points: Vec<(f64, f64)> =
            (0..10).map(|i| (i as f64, i as f64 + if i % 2 == 0 { 1.0 } else { -1.0 })).collect();
        assert_eq!(envelope(&points, 2), [(2.25, 5.0), (6.75, 9.0), (6.75, 4.0), (2.25, 0.0)]);
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
        assert_eq!(format_tick(0.000123, 1e-3), "1.2e-4");
        assert_eq!(format_tick(0.5, 1.0), "0.5");
        assert_eq!(format_tick(2.0, 1.0), "2");
        assert_eq!(format_tick(12345.678, 1e4), "12345.678");
        assert_eq!(format_tick(-0.0001, 1e-3), "-1.0e-4");
        assert_eq!(format_tick(0.0, 1.0), "0");
        assert_eq!(format_tick(-2.8e-17, 0.7), "0");
        assert_eq!(format_tick(1e-12, 1e-11), "1.0e-12");
    }
}
