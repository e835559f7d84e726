//! Records to [`PreferenceRow`]s: DS-Chat's per-dataset column mappings
//! (`dschat/utils/data/raw_datasets.py`, each class's `get_prompt`, `get_chosen`,
//! `get_rejected`), the verbatim key mapping for local files and generic hub datasets, and the
//! JSON-lines / JSON-array / parquet readers that turn every record into a JSON object first, so
//! that a mapping reads nested parquet columns (webgpt's `question.full_text`) as it reads JSON.

use std::fs::File;
use std::path::Path;

use anyhow::{anyhow, bail, Result};
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::{Field, Row};
use parquet::schema::types::Type as SchemaType;
use serde_json::{Map, Value};

use super::{ColumnKeys, EvalSplit, PreferenceRow};

/// The preference datasets DS-Chat's `get_raw_dataset` knows (its SFT-only Chinese and Japanese
/// datasets have no rejected answer and are left out).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DsChat {
    RmStatic,
    FullHhRlhf,
    SyntheticInstructGptjPairwise,
    YitingxieRlhfRewardDatasets,
    OpenaiWebgptComparisons,
    StanfordnlpShp,
}

impl DsChat {
    pub(crate) const ALL: [DsChat; 6] = [
        DsChat::RmStatic,
        DsChat::FullHhRlhf,
        DsChat::SyntheticInstructGptjPairwise,
        DsChat::YitingxieRlhfRewardDatasets,
        DsChat::OpenaiWebgptComparisons,
        DsChat::StanfordnlpShp,
    ];

    /// The hub id, which is also the name DS-Chat matches on.
    pub(crate) fn name(self) -> &'static str {
        match self {
            DsChat::RmStatic => "Dahoas/rm-static",
            DsChat::FullHhRlhf => "Dahoas/full-hh-rlhf",
            DsChat::SyntheticInstructGptjPairwise => "Dahoas/synthetic-instruct-gptj-pairwise",
            DsChat::YitingxieRlhfRewardDatasets => "yitingxie/rlhf-reward-datasets",
            DsChat::OpenaiWebgptComparisons => "openai/webgpt_comparisons",
            DsChat::StanfordnlpShp => "stanfordnlp/SHP",
        }
    }

    /// Exactly one of the names. DS-Chat needs the `org/` prefix too (`get_raw_dataset` tests
    /// `"Dahoas/rm-static" in dataset_name`), so `rm-static` alone is not a name here either.
    pub(super) fn from_name(spec: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|d| d.name() == spec)
    }

    /// The dataset whose name a local path contains: DS-Chat's substring match, which lets a
    /// `save_to_disk`/downloaded copy under `…/Dahoas/rm-static` keep its mapping.
    pub(super) fn in_path(spec: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|d| spec.contains(d.name()))
    }

    pub(super) fn eval_split(self) -> EvalSplit {
        match self {
            DsChat::RmStatic | DsChat::FullHhRlhf | DsChat::YitingxieRlhfRewardDatasets => EvalSplit::Test,
            DsChat::StanfordnlpShp => EvalSplit::Validation,
            DsChat::SyntheticInstructGptjPairwise | DsChat::OpenaiWebgptComparisons => EvalSplit::SplitTrain,
        }
    }

    pub(super) fn columns(self) -> &'static [&'static str] {
        match self {
            DsChat::RmStatic
            | DsChat::FullHhRlhf
            | DsChat::SyntheticInstructGptjPairwise
            | DsChat::YitingxieRlhfRewardDatasets => &["prompt", "chosen", "rejected"],
            DsChat::OpenaiWebgptComparisons => &["question", "answer_0", "answer_1", "score_0", "score_1"],
            DsChat::StanfordnlpShp => &["history", "human_ref_A", "human_ref_B", "labels"],
        }
    }

    /// `get_prompt`, `get_chosen` and `get_rejected` of the dataset's class in raw_datasets.py.
    pub(super) fn map(self, obj: &Map<String, Value>) -> Result<PreferenceRow, String> {
        let human = |q: &str| format!(" Human: {q} Assistant:");
        let spaced = |a: &str| format!(" {a}");
        let row = match self {
            DsChat::RmStatic | DsChat::FullHhRlhf => PreferenceRow {
                prompt: text(obj, "prompt")?.map(str::to_owned),
                chosen: text(obj, "chosen")?.map(str::to_owned),
                rejected: text(obj, "rejected")?.map(str::to_owned),
            },
            DsChat::SyntheticInstructGptjPairwise => PreferenceRow {
                prompt: text(obj, "prompt")?.map(human),
                chosen: text(obj, "chosen")?.map(spaced),
                rejected: text(obj, "rejected")?.map(spaced),
            },
            DsChat::YitingxieRlhfRewardDatasets => {
                // `sample['chosen'].split("Assistant:")[-1]`: the text after the last marker,
                // or all of it when there is none.
                let last_answer = |a: &str| a.rsplit("Assistant:").next().unwrap_or(a).to_owned();
                PreferenceRow {
                    prompt: text(obj, "prompt")?.map(|p| format!("{p}Assistant:")),
                    chosen: text(obj, "chosen")?.map(last_answer),
                    rejected: text(obj, "rejected")?.map(last_answer),
                }
            }
            DsChat::OpenaiWebgptComparisons => {
                let question = match obj.get("question") {
                    None | Some(Value::Null) => None,
                    Some(Value::Object(q)) => text(q, "full_text")?,
                    Some(other) => return Err(format!("field \"question\" holds {}, not an object", kind(other))),
                };
                let (s0, s1) = (number(obj, "score_0")?, number(obj, "score_1")?);
                let (a0, a1) = (text(obj, "answer_0")?, text(obj, "answer_1")?);
                let answer = |a: Option<&str>| a.map(|a| format!(" {}", strip_citations(a)));
                // `>=` for chosen and `<` for rejected, as DS-Chat writes them: a tie makes
                // answer_0 chosen and answer_1 rejected.
                let (chosen, rejected) = match (s0, s1) {
                    (Some(s0), Some(s1)) => {
                        (answer(if s0 >= s1 { a0 } else { a1 }), answer(if s0 < s1 { a0 } else { a1 }))
                    }
                    _ => (None, None),
                };
                PreferenceRow { prompt: question.map(human), chosen, rejected }
            }
            DsChat::StanfordnlpShp => {
                let (a, b) = (text(obj, "human_ref_A")?, text(obj, "human_ref_B")?);
                // `int(sample["labels"]) == 1` picks human_ref_A.
                let (chosen, rejected) = match number(obj, "labels")? {
                    Some(label) if label.trunc() == 1.0 => (a, b),
                    Some(_) => (b, a),
                    None => (None, None),
                };
                PreferenceRow {
                    prompt: text(obj, "history")?.map(human),
                    chosen: chosen.map(spaced),
                    rejected: rejected.map(spaced),
                }
            }
        };
        Ok(row)
    }
}

/// How a record becomes a row.
#[derive(Clone, Debug)]
pub(super) enum Mapping {
    /// Verbatim values of the three key columns (rm-static's form). Deviation: DS-Chat's only
    /// local source, `local/jsonfile`, puts a space before each value; `--data-path
    /// local/jsonfile` ([`Mapping::LocalJsonfile`]) restores that.
    Keys(ColumnKeys),
    /// DS-Chat's `LocalJsonFileDataset`: a space before the prompt and before each answer.
    LocalJsonfile(ColumnKeys),
    DsChat(DsChat),
}

impl Mapping {
    pub(super) fn columns(&self) -> Vec<&str> {
        match self {
            Mapping::Keys(k) | Mapping::LocalJsonfile(k) => vec![&k.prompt, &k.chosen, &k.rejected],
            Mapping::DsChat(ds) => ds.columns().to_vec(),
        }
    }

    pub(super) fn map(&self, obj: &Map<String, Value>) -> Result<PreferenceRow, String> {
        let (keys, prefix) = match self {
            Mapping::DsChat(ds) => return ds.map(obj),
            Mapping::Keys(keys) => (keys, ""),
            Mapping::LocalJsonfile(keys) => (keys, " "),
        };
        let get = |key: &str, flag: &str| match text(obj, key) {
            Ok(v) => Ok(v.map(|v| format!("{prefix}{v}"))),
            Err(e) => Err(format!("{e}; set {flag} to a text column")),
        };
        Ok(PreferenceRow {
            prompt: get(&keys.prompt, "--prompt-key")?,
            chosen: get(&keys.chosen, "--chosen-key")?,
            rejected: get(&keys.rejected, "--rejected-key")?,
        })
    }

    /// The error for a file holding none of the columns the mapping reads.
    fn missing_columns(&self, name: &str, present: &[String]) -> anyhow::Error {
        let wanted: Vec<String> = self.columns().iter().map(|c| format!("\"{c}\"")).collect();
        let fix = match self {
            Mapping::Keys(_) | Mapping::LocalJsonfile(_) => {
                "set --prompt-key, --chosen-key and --rejected-key to the columns holding the \
                 prompt and the chosen and rejected answers"
                    .to_string()
            }
            Mapping::DsChat(ds) => format!("DS-Chat's mapping for {} reads them: pass that dataset's files", ds.name()),
        };
        anyhow!(
            "{name} has none of the columns {} (columns: {}); {fix}",
            wanted.join(", "),
            crate::printable_list(present)
        )
    }

    /// For the fingerprint.
    pub(super) fn describe(&self) -> String {
        match self {
            Mapping::Keys(k) => format!("keys:{}|{}|{}", k.prompt, k.chosen, k.rejected),
            Mapping::LocalJsonfile(k) => format!("local-jsonfile:{}|{}|{}", k.prompt, k.chosen, k.rejected),
            Mapping::DsChat(ds) => format!("ds-chat:{}", ds.name()),
        }
    }
}

/// A text field: `None` when absent or null, an error when it holds something else.
fn text<'a>(obj: &'a Map<String, Value>, key: &str) -> Result<Option<&'a str>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(format!("field \"{key}\" holds {}, not text", kind(other))),
    }
}

/// A numeric field as Python's `float()`/`int()` would read it (numbers, booleans, numeric text).
fn number(obj: &Map<String, Value>, key: &str) -> Result<Option<f64>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(Value::Bool(b)) => Ok(Some(f64::from(u8::from(*b)))),
        Some(Value::String(s)) => {
            s.trim().parse().map(Some).map_err(|_| format!("field \"{key}\" holds {s:?}, not a number"))
        }
        Some(other) => Err(format!("field \"{key}\" holds {}, not a number", kind(other))),
    }
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "text",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// webgpt's citations removed as DS-Chat does: `re.sub(r" [\(\[].*?[\)\]]", "", s)`, then
/// `re.sub(r"[\(\[].*?[\)\]]", "", s)` (`.` stops at a newline).
fn strip_citations(s: &str) -> String {
    remove_bracketed(&remove_bracketed(s, true), false)
}

/// One left-to-right `re.sub` pass: at each position, an opening `(`/`[` (after a space when
/// `after_space`) up to the first `)`/`]` on the same line is removed; otherwise the character
/// is kept.
fn remove_bracketed(s: &str, after_space: bool) -> String {
    let chars: Vec<char> = s.chars().collect();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < chars.len() {
        let open = if after_space { i + 1 } else { i };
        let starts = (!after_space || chars[i] == ' ') && matches!(chars.get(open), Some('(' | '['));
        let close = if starts {
            chars[open + 1..].iter().take_while(|&&c| c != '\n').position(|&c| c == ')' || c == ']')
        } else {
            None
        };
        match close {
            Some(offset) => i = open + 1 + offset + 1,
            None => {
                out.push(chars[i]);
                i += 1;
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Reading records: JSON lines / JSON arrays and parquet, every row as a JSON object.

/// Rows of a JSON-lines or JSON-array text; `name` is for errors.
pub(super) fn json_rows(bytes: &[u8], name: &str, mapping: &Mapping) -> Result<Vec<PreferenceRow>> {
    let text = std::str::from_utf8(bytes).map_err(|e| anyhow!("{name} is not UTF-8 text ({e}); save it as UTF-8"))?;
    // Some editors on Windows start UTF-8 files with a byte-order mark serde_json rejects.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let wanted = mapping.columns();
    let mut rows = Vec::new();
    let mut any_column = false;
    let mut first_keys: Option<Vec<String>> = None;
    let mut take = |value: Value, at: &dyn Fn() -> String| -> Result<()> {
        let Value::Object(obj) = value else {
            bail!("{}: expected a JSON object with a \"{}\" field, got {}", at(), wanted[0], kind(&value));
        };
        any_column |= wanted.iter().any(|c| obj.contains_key(*c));
        first_keys.get_or_insert_with(|| obj.keys().cloned().collect());
        rows.push(mapping.map(&obj).map_err(|e| anyhow!("{}: {e}", at()))?);
        Ok(())
    };
    if text.trim_start().starts_with('[') {
        let values: Vec<Value> = serde_json::from_str(text)
            .map_err(|e| anyhow!("{name}: invalid JSON array ({e}); fix the file or write one JSON object per line"))?;
        for (index, value) in values.into_iter().enumerate() {
            take(value, &|| format!("{name} element {}", index + 1))?;
        }
    } else {
        for (index, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let line_no = index + 1;
            let value: Value =
                serde_json::from_str(line).map_err(|e| anyhow!("{name} line {line_no}: invalid JSON ({e})"))?;
            take(value, &|| format!("{name} line {line_no}"))?;
        }
    }
    if !rows.is_empty() && !any_column {
        return Err(mapping.missing_columns(name, &first_keys.unwrap_or_default()));
    }
    Ok(rows)
}

/// Rows of a parquet file, read only from the columns the mapping needs; nested columns (webgpt's
/// `question` struct) become JSON objects. The parquet crate's panics on malformed files are
/// contained ([`crate::panics`]).
fn parquet_rows(path: &Path, name: &str, mapping: &Mapping) -> Result<Vec<PreferenceRow>> {
    crate::panics::contain(name, || parquet_rows_uncontained(path, name, mapping))
}

fn parquet_rows_uncontained(path: &Path, name: &str, mapping: &Mapping) -> Result<Vec<PreferenceRow>> {
    let file = File::open(path).map_err(|e| anyhow!("cannot open {name} ({e}); pass an existing, readable file"))?;
    let reader = SerializedFileReader::new(file)
        .map_err(|e| anyhow!("{name} is not a valid parquet file ({e}); pass an intact file"))?;
    let root = reader.metadata().file_metadata().schema_descr().root_schema();
    let wanted = mapping.columns();
    let fields: Vec<_> = root.get_fields().iter().filter(|f| wanted.contains(&f.name())).cloned().collect();
    if fields.is_empty() {
        let present: Vec<String> = root.get_fields().iter().map(|f| f.name().to_string()).collect();
        return Err(mapping.missing_columns(name, &present));
    }
    // Project onto the needed columns so that the others are never decoded.
    let projection = SchemaType::group_type_builder(root.name())
        .with_fields(fields)
        .build()
        .map_err(|e| anyhow!("{name}: cannot select columns {} ({e})", wanted.join(", ")))?;
    let iter = reader.get_row_iter(Some(projection)).map_err(|e| anyhow!("{name}: cannot read rows ({e})"))?;
    let mut rows = Vec::new();
    for (index, row) in iter.enumerate() {
        let row_no = index + 1;
        let row = row.map_err(|e| anyhow!("{name} row {row_no}: cannot read ({e}); the file may be truncated"))?;
        let obj = row_to_object(&row);
        rows.push(mapping.map(&obj).map_err(|e| anyhow!("{name} row {row_no}: {e}"))?);
    }
    Ok(rows)
}

fn row_to_object(row: &Row) -> Map<String, Value> {
    row.get_column_iter().map(|(k, f)| (k.clone(), field_to_json(f))).collect()
}

/// A parquet value as JSON (the `json` feature's `to_json_value`, without its base64 dependency:
/// binary columns are read as UTF-8 text, lossily).
fn field_to_json(field: &Field) -> Value {
    let float = |x: f64| serde_json::Number::from_f64(x).map_or(Value::Null, Value::Number);
    match field {
        Field::Null => Value::Null,
        Field::Bool(b) => Value::Bool(*b),
        Field::Byte(n) => Value::from(*n),
        Field::Short(n) => Value::from(*n),
        Field::Int(n) => Value::from(*n),
        Field::Long(n) => Value::from(*n),
        Field::UByte(n) => Value::from(*n),
        Field::UShort(n) => Value::from(*n),
        Field::UInt(n) => Value::from(*n),
        Field::ULong(n) => Value::from(*n),
        Field::Float16(x) => float(f64::from(*x)),
        Field::Float(x) => float(f64::from(*x)),
        Field::Double(x) => float(*x),
        Field::Str(s) => Value::String(s.clone()),
        Field::Bytes(b) => Value::String(String::from_utf8_lossy(b.data()).into_owned()),
        Field::Group(row) => Value::Object(row_to_object(row)),
        Field::ListInternal(list) => Value::Array(list.elements().iter().map(field_to_json).collect()),
        Field::MapInternal(map) => Value::Object(
            map.entries()
                .iter()
                .map(|(k, v)| {
                    let key = match field_to_json(k) {
                        Value::String(s) => s,
                        other => other.to_string(),
                    };
                    (key, field_to_json(v))
                })
                .collect(),
        ),
        // Decimals, dates and times: their display form.
        other => Value::String(other.to_string()),
    }
}

/// Rows of one local data file, by extension.
pub(super) fn file_rows(path: &Path, mapping: &Mapping) -> Result<Vec<PreferenceRow>> {
    let name = path.display().to_string();
    match extension(path).as_deref() {
        Some("jsonl" | "json") => {
            let bytes = std::fs::read(path).map_err(|e| anyhow!("cannot read {name} ({e}); pass a readable file"))?;
            json_rows(&bytes, &name, mapping)
        }
        Some("parquet") => parquet_rows(path, &name, mapping),
        _ => bail!("{name} is not a .jsonl, .json or .parquet file; convert it to one of those"),
    }
}

pub(super) fn extension(path: &Path) -> Option<String> {
    path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn row(prompt: &str, chosen: &str, rejected: &str) -> PreferenceRow {
        PreferenceRow { prompt: Some(prompt.into()), chosen: Some(chosen.into()), rejected: Some(rejected.into()) }
    }

    fn obj(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            other => panic!("test record must be an object, got {other}"),
        }
    }

    fn keys() -> ColumnKeys {
        ColumnKeys::default()
    }

    #[test]
    fn rm_static_and_full_hh_rows_are_taken_verbatim() -> Result<(), String> {
        let record = obj(json!({
            "prompt": "\n\nHuman: Hi?\n\nAssistant:", "response": " Hello.",
            "chosen": " Hello.", "rejected": " Go away."
        }));
        let want = row("\n\nHuman: Hi?\n\nAssistant:", " Hello.", " Go away.");
        assert_eq!(DsChat::RmStatic.map(&record)?, want);
        assert_eq!(DsChat::FullHhRlhf.map(&record)?, want);
        Ok(())
    }

    #[test]
    fn synthetic_instruct_wraps_the_prompt_and_spaces_the_answers() -> Result<(), String> {
        let record = obj(json!({"prompt": "Name a color.", "chosen": "Blue.", "rejected": "Seven."}));
        let got = DsChat::SyntheticInstructGptjPairwise.map(&record)?;
        assert_eq!(got, row(" Human: Name a color. Assistant:", " Blue.", " Seven."));
        Ok(())
    }

    #[test]
    fn yitingxie_answer_is_the_text_after_the_last_assistant_marker() -> Result<(), String> {
        let record = obj(json!({
            "prompt": "\n\nHuman: Q1\n\n",
            "chosen": "Assistant: A1\n\nHuman: Q2\n\nAssistant: A2 is good",
            "rejected": "no marker at all"
        }));
        let got = DsChat::YitingxieRlhfRewardDatasets.map(&record)?;
        assert_eq!(got, row("\n\nHuman: Q1\n\nAssistant:", " A2 is good", "no marker at all"));
        Ok(())
    }

    #[test]
    fn webgpt_citations_are_stripped_like_ds_chat_regexes() {
        // First pass removes " [1]" / " (x)" with their leading space, second pass the rest.
        assert_eq!(strip_citations("Paris is big [1] and old (source)."), "Paris is big and old.");
        assert_eq!(strip_citations("word[2][3], next"), "word, next");
        // Lazy: up to the first closer of either kind, even across another opener.
        assert_eq!(strip_citations("a [[1] b] c"), "a b] c");
        assert_eq!(strip_citations("x (open ] y"), "x y");
        // `.` does not cross a newline, so an unclosed bracket on its line stays.
        assert_eq!(strip_citations("keep [this\nline] too"), "keep [this\nline] too");
        assert_eq!(strip_citations("a [x\n(y) z"), "a [x\n z");
        assert_eq!(strip_citations("héllo [¹] wörld"), "héllo wörld");
        assert_eq!(strip_citations("no citations"), "no citations");
    }

    #[test]
    fn webgpt_higher_score_is_chosen_and_a_tie_keeps_answer_0_chosen() -> Result<(), String> {
        let map = |s0: f64, s1: f64| {
            DsChat::OpenaiWebgptComparisons.map(&obj(json!({
                "question": {"id": "q1", "full_text": "Why is the sky blue?"},
                "answer_0": "Rayleigh scattering [1].", "answer_1": "Magic (citation needed).",
                "score_0": s0, "score_1": s1
            })))
        };
        let zero_wins = row(" Human: Why is the sky blue? Assistant:", " Rayleigh scattering.", " Magic.");
        let one_wins = row(" Human: Why is the sky blue? Assistant:", " Magic.", " Rayleigh scattering.");
        assert_eq!(map(1.0, -1.0)?, zero_wins);
        assert_eq!(map(-0.5, 0.5)?, one_wins);
        // DS-Chat: chosen when score_0 >= score_1, rejected when score_0 < score_1.
        assert_eq!(map(0.0, 0.0)?, zero_wins);
        // Missing scores or question: None, for the phase builders to count.
        let partial = DsChat::OpenaiWebgptComparisons.map(&obj(json!({"answer_0": "a", "answer_1": "b"})))?;
        assert_eq!(partial, PreferenceRow { prompt: None, chosen: None, rejected: None });
        Ok(())
    }

    #[test]
    fn shp_label_1_picks_human_ref_a() -> Result<(), String> {
        let map = |label: Value| {
            DsChat::StanfordnlpShp.map(&obj(json!({
                "history": "Is tea better than coffee?", "human_ref_A": "Tea.", "human_ref_B": "Coffee.",
                "labels": label
            })))
        };
        let prompt = " Human: Is tea better than coffee? Assistant:";
        assert_eq!(map(json!(1))?, row(prompt, " Tea.", " Coffee."));
        assert_eq!(map(json!(0))?, row(prompt, " Coffee.", " Tea."));
        assert_eq!(map(json!(true))?, row(prompt, " Tea.", " Coffee."));
        assert_eq!(map(json!("1"))?, row(prompt, " Tea.", " Coffee."));
        let err = map(json!([1])).unwrap_err();
        assert!(err.contains("field \"labels\" holds an array, not a number"), "{err}");
        Ok(())
    }

    #[test]
    fn key_mapping_gives_none_for_missing_and_errors_on_non_text() -> Result<(), String> {
        let mapping = Mapping::Keys(keys());
        let got = mapping.map(&obj(json!({"prompt": "p", "chosen": null})))?;
        assert_eq!(got, PreferenceRow { prompt: Some("p".into()), chosen: None, rejected: None });
        let err = mapping.map(&obj(json!({"prompt": "p", "chosen": 5}))).unwrap_err();
        assert!(err.contains("field \"chosen\" holds a number, not text; set --chosen-key"), "{err}");
        let spaced =
            Mapping::LocalJsonfile(keys()).map(&obj(json!({"prompt": "Q", "chosen": "A", "rejected": "B"})))?;
        assert_eq!(spaced, row(" Q", " A", " B"));
        Ok(())
    }

    // --- Names, ids and file splits ---------------------------------------------------------
}
