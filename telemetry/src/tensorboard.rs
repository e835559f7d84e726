//! TensorBoard event files: the `Event`/`Summary` protocol buffers of TensorBoard's
//! `tensorboard/compat/proto/{event,summary,tensor,tensor_shape}.proto` (only the fields we
//! write), framed as TFRecords in `events.out.tfevents.<time>.<host>.<pid>.<n>`.
//!
//! A run's metrics become scalars: [`scalars_of_record`] turns each `metrics.jsonl` record into
//! `(tag, value)` pairs under our own names, or the names DS-Chat and Megatron give the same
//! quantities where they have one, so dashboards built for them work unchanged. The run's
//! configuration goes to the hparams plugin ([`crate::hparams`]).

use crate::hparams::HParam;
use crate::tfrecord;
use anyhow::{Context, Result};
use prost::Message;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// `tensorboard.Event`: one timestamped entry of an event file.
#[derive(Clone, PartialEq, Message)]
pub struct Event {
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    #[prost(int64, tag = "2")]
    pub step: i64,
    #[prost(oneof = "What", tags = "3, 5")]
    pub what: Option<What>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum What {
    /// The first event of every file: "brain.Event:2".
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
}

/// `tensorboard.Summary`: the values of one step.
#[derive(Clone, PartialEq, Message)]
pub struct Summary {
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

/// `tensorboard.Summary.Value`.
#[derive(Clone, PartialEq, Message)]
pub struct SummaryValue {
    #[prost(string, tag = "1")]
    pub tag: String,
    #[prost(message, optional, tag = "9")]
    pub metadata: Option<SummaryMetadata>,
    #[prost(oneof = "Value", tags = "2, 8")]
    pub value: Option<Value>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Value {
    /// A scalar, which TensorBoard files under its scalars plugin.
    #[prost(float, tag = "2")]
    SimpleValue(f32),
    #[prost(message, tag = "8")]
    Tensor(TensorProto),
}

/// `tensorboard.SummaryMetadata`: which plugin shows the value.
#[derive(Clone, PartialEq, Message)]
pub struct SummaryMetadata {
    #[prost(message, optional, tag = "1")]
    pub plugin_data: Option<PluginData>,
    #[prost(string, tag = "2")]
    pub display_name: String,
    #[prost(string, tag = "3")]
    pub summary_description: String,
}

/// `tensorboard.SummaryMetadata.PluginData`.
#[derive(Clone, PartialEq, Message)]
pub struct PluginData {
    #[prost(string, tag = "1")]
    pub plugin_name: String,
    #[prost(bytes = "vec", tag = "2")]
    pub content: Vec<u8>,
}

/// `tensorboard.TensorProto`, as the text plugin reads it: a string tensor.
#[derive(Clone, PartialEq, Message)]
pub struct TensorProto {
    /// `tensorboard.DataType`; [`DT_STRING`] here.
    #[prost(int32, tag = "1")]
    pub dtype: i32,
    #[prost(message, optional, tag = "2")]
    pub tensor_shape: Option<TensorShapeProto>,
    #[prost(bytes = "vec", repeated, tag = "8")]
    pub string_val: Vec<Vec<u8>>,
}

/// `tensorboard.TensorShapeProto`: no dimensions is a scalar.
#[derive(Clone, PartialEq, Message)]
pub struct TensorShapeProto {
    #[prost(message, repeated, tag = "2")]
    pub dim: Vec<Dim>,
}

#[derive(Clone, PartialEq, Message)]
pub struct Dim {
    #[prost(int64, tag = "1")]
    pub size: i64,
}

pub const DT_STRING: i32 = 7;
pub const FILE_VERSION: &str = "brain.Event:2";

/// Appends events to a new event file in a directory. Each event is one `write` of one framed
/// record, so the file is readable at every moment and a crash loses at most the last event.
pub struct EventWriter {
    path: PathBuf,
    file: std::fs::File,
}

impl EventWriter {
    /// Creates `dir` and a new event file in it, named as TensorFlow names them (TensorBoard
    /// reads every file whose name contains "tfevents"; a resumed run adds a file beside the
    /// earlier ones and TensorBoard shows them as one run).
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create TensorBoard directory {}", dir.display()))?;
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let host = crate::file_name_host(&crate::host_name());
        let pid = std::process::id();
        let (path, file) = (0u32..)
            .map(|n| dir.join(format!("events.out.tfevents.{secs:010}.{host}.{pid}.{n}")))
            .find_map(|path| {
                let file = std::fs::OpenOptions::new().write(true).create_new(true).open(&path);
                match file {
                    Ok(file) => Some(Ok((path, file))),
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => None,
                    Err(e) => Some(Err(e).with_context(|| format!("cannot create {}", path.display()))),
                }
            })
            .expect("an unused file name")?;
        let mut writer = Self { path, file };
        writer.write(&Event { wall_time: now(), step: 0, what: Some(What::FileVersion(FILE_VERSION.into())) })?;
        Ok(writer)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn write(&mut self, event: &Event) -> Result<()> {
        self.file
            .write_all(&tfrecord::frame(&event.encode_to_vec()))
            .with_context(|| format!("writing {}", self.path.display()))
    }

    /// One event holding every scalar of a step (TensorBoard stores them as float32).
    pub fn scalars(&mut self, step: i64, scalars: &[(String, f64)]) -> Result<()> {
        if scalars.is_empty() {
            return Ok(());
        }
        let value = scalars
            .iter()
            .map(|(tag, v)| SummaryValue {
                tag: tag.clone(),
                metadata: None,
                value: Some(Value::SimpleValue(*v as f32)),
            })
            .collect();
        self.write(&Event { wall_time: now(), step, what: Some(What::Summary(Summary { value })) })
    }

    /// The run's hyperparameters (its configuration) in TensorBoard's HPARAMS tab: the session's
    /// start, at step 0.
    pub fn hparams_start(&mut self, hparams: BTreeMap<String, HParam>) -> Result<()> {
        use crate::hparams::{plugin_content, Data, SessionStartInfo, SESSION_START_TAG};
        let content = plugin_content(Data::SessionStartInfo(SessionStartInfo { hparams, start_time_secs: now() }));
        self.plugin_summary(SESSION_START_TAG, content)
    }

    /// The end of the session [`Self::hparams_start`] began, successful or not.
    pub fn hparams_end(&mut self, success: bool) -> Result<()> {
        use crate::hparams::{plugin_content, Data, SessionEndInfo, SESSION_END_TAG, STATUS_FAILURE, STATUS_SUCCESS};
        let status = if success { STATUS_SUCCESS } else { STATUS_FAILURE };
        let content = plugin_content(Data::SessionEndInfo(SessionEndInfo { status, end_time_secs: now() }));
        self.plugin_summary(SESSION_END_TAG, content)
    }

    /// A summary of the hparams plugin: metadata only, as TensorFlow and PyTorch write it.
    fn plugin_summary(&mut self, tag: &str, content: Vec<u8>) -> Result<()> {
        let plugin_data = PluginData { plugin_name: crate::hparams::PLUGIN_NAME.into(), content };
        let metadata = SummaryMetadata { plugin_data: Some(plugin_data), ..Default::default() };
        let value = vec![SummaryValue { tag: tag.into(), metadata: Some(metadata), value: None }];
        self.write(&Event { wall_time: now(), step: 0, what: Some(What::Summary(Summary { value })) })
    }

    /// Markdown under `tag` in TensorBoard's text tab (the run's flags, for instance).
    pub fn text(&mut self, step: i64, tag: &str, markdown: &str) -> Result<()> {
        let metadata = SummaryMetadata {
            plugin_data: Some(PluginData { plugin_name: "text".into(), content: Vec::new() }),
            ..Default::default()
        };
        let tensor = TensorProto {
            dtype: DT_STRING,
            tensor_shape: Some(TensorShapeProto::default()),
            string_val: vec![markdown.as_bytes().to_vec()],
        };
        let value =
            vec![SummaryValue { tag: tag.into(), metadata: Some(metadata), value: Some(Value::Tensor(tensor)) }];
        self.write(&Event { wall_time: now(), step, what: Some(What::Summary(Summary { value })) })
    }
}

fn now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// The events of an event file, every checksum verified; a last event cut short by a crash is
/// left out.
pub fn read_events(path: &Path) -> Result<Vec<Event>> {
    let records = tfrecord::read_file(path)?;
    records
        .records
        .iter()
        .enumerate()
        .map(|(i, r)| {
            Event::decode(r.as_slice()).with_context(|| format!("{}: event {i} is not an Event", path.display()))
        })
        .collect()
}

/// The scalars of an event file as `(step, tag, value)`, in file order.
pub fn read_scalars(path: &Path) -> Result<Vec<(i64, String, f32)>> {
    let mut out = Vec::new();
    for event in read_events(path)? {
        if let Some(What::Summary(summary)) = event.what {
            for v in summary.value {
                if let Some(Value::SimpleValue(x)) = v.value {
                    out.push((event.step, v.tag, x));
                }
            }
        }
    }
    Ok(out)
}

/// Every text summary of an event file, as (step, tag, text).
pub fn read_texts(path: &Path) -> Result<Vec<(i64, String, String)>> {
    let mut out = Vec::new();
    for event in read_events(path)? {
        if let Some(What::Summary(summary)) = event.what {
            for v in summary.value {
                if let Some(Value::Tensor(t)) = v.value.filter(|_| is_text(v.metadata.as_ref())) {
                    for text in t.string_val {
                        out.push((event.step, v.tag.clone(), String::from_utf8_lossy(&text).into_owned()));
                    }
                }
            }
        }
    }
    Ok(out)
}

/// The hparams plugin's session of an event file: its hyperparameters, and its end status
/// ([`crate::hparams::STATUS_SUCCESS`], ...) when it ended; None without a session start.
pub fn read_hparams(path: &Path) -> Result<Option<crate::hparams::Session>> {
    use crate::hparams::{Data, HParamsPluginData, PLUGIN_NAME};
    let (mut start, mut status) = (None, None);
    for event in read_events(path)? {
        let Some(What::Summary(summary)) = event.what else { continue };
        for v in summary.value {
            let Some(p) = v.metadata.and_then(|m| m.plugin_data).filter(|p| p.plugin_name == PLUGIN_NAME) else {
                continue;
            };
            match HParamsPluginData::decode(p.content.as_slice()).context("an hparams summary")?.data {
                Some(Data::SessionStartInfo(s)) => start = Some(s.hparams),
                Some(Data::SessionEndInfo(e)) => status = Some(e.status),
                None => {}
            }
        }
    }
    Ok(start.map(|hparams| crate::hparams::Session { hparams, status }))
}

/// Whether a summary value's metadata names TensorBoard's text plugin.
fn is_text(metadata: Option<&SummaryMetadata>) -> bool {
    metadata.and_then(|m| m.plugin_data.as_ref()).is_some_and(|p| p.plugin_name == "text")
}

/// The names other systems give our metrics, under which the sinks write them instead of ours:
/// `(our key, their tag, factor)`. Megatron's `training_log` and `evaluate_and_print_results`
/// for pretraining (its iteration time is in seconds); DS-Chat's step 3 `main.py` (`reward` is
/// the rollout's mean).
pub const MEGATRON_TAGS: &[(&str, &str, f64)] = &[
    ("lm_loss", "lm loss", 1.0),
    ("lr", "learning-rate", 1.0),
    ("loss_scale", "loss-scale", 1.0),
    ("grad_norm", "grad-norm", 1.0),
    ("ms_per_iteration", "iteration-time", 1e-3),
    ("valid_loss", "lm loss validation", 1.0),
    ("valid_ppl", "lm loss validation ppl", 1.0),
];
pub const DS_CHAT_STEP3_TAGS: &[(&str, &str, f64)] = &[("rollout/reward_mean", "reward", 1.0)];

/// The step a record belongs to (`step`, or pretraining's `iteration`), if it names one.
pub fn step_of(record: &serde_json::Value) -> Option<i64> {
    ["step", "iteration"].iter().find_map(|k| record.get(*k)?.as_i64())
}

/// Follows a run's records to give each its step: its own (`step`, or pretraining's
/// `iteration`), else the last one seen (an evaluation record belongs to the step it follows).
pub struct RecordScalars {
    pub aliases: &'static [(&'static str, &'static str, f64)],
    pub last_step: i64,
}

impl RecordScalars {
    /// A run's records from step `start` on (0, or where a resumed run continues).
    pub fn new(aliases: &'static [(&'static str, &'static str, f64)], start: i64) -> Self {
        Self { aliases, last_step: start }
    }

    /// The step of `record` and its scalars ([`scalars_of_record`]).
    pub fn of(&mut self, record: &serde_json::Value) -> (i64, Vec<(String, f64)>) {
        self.last_step = step_of(record).unwrap_or(self.last_step);
        (self.last_step, scalars_of_record(record, self.aliases))
    }
}

/// The scalars a run's event file holds for its `metrics.jsonl` records, as [`read_scalars`]
/// gives them back: what a test compares an event file with.
pub fn scalars_of_records(
    records: &[serde_json::Value],
    aliases: &'static [(&'static str, &'static str, f64)],
    start: i64,
) -> Vec<(i64, String, f32)> {
    let mut steps = RecordScalars::new(aliases, start);
    let mut out = Vec::new();
    for record in records {
        let (step, scalars) = steps.of(record);
        out.extend(scalars.into_iter().map(|(tag, x)| (step, tag, x as f32)));
    }
    out
}

/// Every number of a `metrics.jsonl` record as a scalar, nested objects joined with `/`
/// (`rollout/reward_mean`, `eval/accuracy`); true/false as 1/0; strings, nulls and lists left
/// out; the step itself and a closing record's `summary` left out. A key that `aliases` names goes under the alias instead (times
/// its factor): one tag per value, the one Megatron's or DS-Chat's dashboards know.
pub fn scalars_of_record(record: &serde_json::Value, aliases: &[(&str, &str, f64)]) -> Vec<(String, f64)> {
    fn walk(prefix: &str, value: &serde_json::Value, out: &mut Vec<(String, f64)>) {
        match value {
            serde_json::Value::Number(n) => out.extend(n.as_f64().map(|x| (prefix.to_string(), x))),
            serde_json::Value::Bool(b) => out.push((prefix.to_string(), f64::from(u8::from(*b)))),
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}/{k}") };
                    walk(&key, v, out);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    if let serde_json::Value::Object(map) = record {
        // A run's closing summary repeats what its records said (and a step's evaluation is a
        // record of its own): written again it would be each value twice.
        for (k, v) in map.iter().filter(|(k, _)| !matches!(k.as_str(), "step" | "iteration" | "summary")) {
            walk(k, v, &mut out);
        }
    }
    // One tag per value: a key with a name other dashboards use goes under that name only.
    for (key, x) in &mut out {
        if let Some((_, tag, factor)) = aliases.iter().find(|(k, _, _)| k == key) {
            (*key, *x) = (tag.to_string(), *x * factor);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn records_become_scalars_under_their_dashboards_names_where_they_have_one() {
        let record = json!({"iteration": 7, "lm_loss": 2.5, "lr": 1e-3, "skipped": false,
            "ms_per_iteration": 250.0, "note": "text", "list": [1, 2], "none": null,
            "rollout": {"reward_mean": 1.5, "kl": {"k3": 0.25}}});
        assert_eq!(step_of(&record), Some(7));
        let mut got = scalars_of_record(&record, MEGATRON_TAGS);
        got.sort_by(|a, b| a.0.cmp(&b.0));
        let want = [
            ("iteration-time", 0.25),
            ("learning-rate", 1e-3),
            ("lm loss", 2.5),
            ("rollout/kl/k3", 0.25),
            ("rollout/reward_mean", 1.5),
            ("skipped", 0.0),
        ];
        assert_eq!(got, want.map(|(k, v)| (k.to_string(), v)));
        let step3 = scalars_of_record(&json!({"step": 3, "rollout": {"reward_mean": 4.0}}), DS_CHAT_STEP3_TAGS);
        assert_eq!(step3, vec![("reward".into(), 4.0)]);
        assert_eq!(step_of(&json!({"epoch": 1, "eval_loss": 2.0})), None);
        // The closing summary repeats the records: left out.
        let end = json!({"event": "end", "summary": {"valid_loss": 2.0, "sft_eval": {"reward_mean": 1.0}}, "peak_rss_mib": 9.0});
        assert_eq!(scalars_of_record(&end, MEGATRON_TAGS), vec![("peak_rss_mib".into(), 9.0)]);
    }

    #[test]
    fn an_event_file_reads_back_with_its_scalars_and_text() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        w.scalars(1, &[("loss".into(), 2.0), ("lr".into(), 1e-3)]).unwrap();
        w.scalars(2, &[("loss".into(), 1.5)]).unwrap();
        w.text(0, "flags", "`--lr 1e-3`").unwrap();
        let name = w.path().file_name().unwrap().to_string_lossy().to_string();
        assert!(name.starts_with("events.out.tfevents.") && name.ends_with(&format!(".{}.0", std::process::id())));
        // A second writer in the same second gets its own file.
        let second = EventWriter::create(dir.path()).unwrap();
        assert_ne!(second.path(), w.path());

        let events = read_events(w.path()).unwrap();
        assert_eq!(events[0].what, Some(What::FileVersion(FILE_VERSION.into())));
        assert_eq!(
            read_scalars(w.path()).unwrap(),
            vec![(1, "loss".into(), 2.0), (1, "lr".into(), 1e-3), (2, "loss".into(), 1.5)]
        );
        let Some(What::Summary(text)) = &events[3].what else { panic!("a summary: {:?}", events[3]) };
        let v = &text.value[0];
        assert_eq!(v.metadata.as_ref().unwrap().plugin_data.as_ref().unwrap().plugin_name, "text");
        let Some(Value::Tensor(t)) = &v.value else { panic!("a tensor") };
        assert_eq!((t.dtype, t.string_val.clone()), (DT_STRING, vec![b"`--lr 1e-3`".to_vec()]));
        assert_eq!(read_texts(w.path()).unwrap(), vec![(0, "flags".to_string(), "`--lr 1e-3`".to_string())]);
    }

    #[test]
    fn a_sessions_hyperparameters_and_its_end_read_back_as_the_hparams_plugin_holds_them() {
        use crate::hparams::{HParam, Session, SESSION_END_TAG, SESSION_START_TAG, STATUS_FAILURE, STATUS_SUCCESS};
        let dir = tempfile::tempdir().unwrap();
        let hparams: BTreeMap<String, HParam> =
            [("lr".to_string(), HParam::number(1e-3)), ("dtype".into(), HParam::text("bf16"))].into();
        // The clock read here, not through the `now` under test.
        let clock = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
        let before = clock();
        let mut w = EventWriter::create(dir.path()).unwrap();
        // A text summary first: another plugin's summary is not the session.
        w.text(0, "flags", "`--lr 1e-3`").unwrap();
        w.hparams_start(hparams.clone()).unwrap();
        assert_eq!(
            read_hparams(w.path()).unwrap(),
            Some(Session { hparams: hparams.clone(), status: None }),
            "started, not ended"
        );
        w.hparams_end(false).unwrap();
        let after = clock();
        assert_eq!(read_hparams(w.path()).unwrap(), Some(Session { hparams, status: Some(STATUS_FAILURE) }));

        // Each a summary of the plugin, metadata only, at step 0, under the plugin's tags.
        let events = read_events(w.path()).unwrap();
        for (event, tag) in events[2..].iter().zip([SESSION_START_TAG, SESSION_END_TAG]) {
            let Some(What::Summary(summary)) = &event.what else { panic!("a summary: {event:?}") };
            let v = &summary.value[0];
            assert_eq!((event.step, v.tag.as_str(), v.value.is_none()), (0, tag, true));
            let plugin = v.metadata.as_ref().and_then(|m| m.plugin_data.as_ref()).expect("plugin data");
            assert_eq!(plugin.plugin_name, crate::hparams::PLUGIN_NAME);
        }
        // Every event carries the time it was written.
        assert!(events.iter().all(|e| (before..=after).contains(&e.wall_time)), "{before} {after} {events:?}");

        let mut ok = EventWriter::create(dir.path()).unwrap();
        ok.hparams_end(true).unwrap();
        assert_eq!(read_hparams(ok.path()).unwrap(), None, "an end without a start is no session");
        ok.hparams_start(BTreeMap::new()).unwrap();
        let session = read_hparams(ok.path()).unwrap().expect("a session");
        assert_eq!(session.status, Some(STATUS_SUCCESS));
    }

    #[test]
    fn only_the_text_plugins_tensors_are_text() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        let tensor = TensorProto { dtype: DT_STRING, tensor_shape: None, string_val: vec![b"not text".to_vec()] };
        let other = SummaryMetadata {
            plugin_data: Some(PluginData { plugin_name: "pr_curves".into(), content: Vec::new() }),
            ..Default::default()
        };
        for metadata in [None, Some(other)] {
            let value = vec![SummaryValue { tag: "t".into(), metadata, value: Some(Value::Tensor(tensor.clone())) }];
            w.write(&Event { wall_time: 0.0, step: 1, what: Some(What::Summary(Summary { value })) }).unwrap();
        }
        w.text(2, "flags", "yes").unwrap();
        assert_eq!(read_texts(w.path()).unwrap(), vec![(2, "flags".to_string(), "yes".to_string())]);
    }

    #[test]
    fn a_directory_that_takes_no_file_is_an_error_not_a_search_for_a_free_name() {
        // /proc/self exists and is a directory, and no one can create a file in it; only a name
        // already taken moves the writer on to the next number.
        let Ok(meta) = std::fs::metadata("/proc/self") else { return };
        assert!(meta.is_dir());
        let err = EventWriter::create(Path::new("/proc/self")).err().expect("no file in /proc/self");
        assert!(format!("{err:#}").contains("cannot create /proc/self/events.out.tfevents."), "{err:#}");
    }
}
