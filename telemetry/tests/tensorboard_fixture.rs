//! The committed event file (written by our writer, `scripts/make-tensorboard-fixture.sh`) read
//! by our reader gives exactly what TensorBoard's own reader read from it when the fixture was
//! made (expected.json): the same tags, steps, float32 values and text; and the hparams plugin's
//! summaries decode, by our messages, to what TensorBoard's own hparams protos decoded.

use prost::Message;
use std::collections::BTreeMap;
use std::path::Path;
use telemetry::hparams::{Data, HParamsPluginData, Kind, PLUGIN_NAME};
use telemetry::tensorboard::{read_events, Value, What, FILE_VERSION};

type Series<T> = BTreeMap<String, Vec<(i64, T)>>;

#[test]
fn our_reader_reads_what_tensorboard_read_from_our_event_file() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tensorboard");
    let events_file = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.file_name().unwrap().to_string_lossy().starts_with("events.out.tfevents."))
        .expect("the fixture's event file");
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();

    let events = read_events(&events_file).unwrap();
    assert_eq!(events[0].what, Some(What::FileVersion(FILE_VERSION.into())), "the first event names the format");
    let (mut scalars, mut text): (Series<f32>, Series<String>) = Default::default();
    let mut hparams = serde_json::Map::new();
    for event in &events[1..] {
        let Some(What::Summary(summary)) = &event.what else { panic!("a summary: {event:?}") };
        for v in &summary.value {
            let plugin = v.metadata.as_ref().and_then(|m| m.plugin_data.as_ref());
            if let Some(p) = plugin.filter(|p| p.plugin_name == PLUGIN_NAME) {
                let decoded = HParamsPluginData::decode(p.content.as_slice()).unwrap();
                let as_json = match decoded.data.expect("session data") {
                    Data::SessionStartInfo(start) => serde_json::Value::Object(
                        start
                            .hparams
                            .into_iter()
                            .map(|(k, v)| {
                                let v = match v.kind.expect("a kind") {
                                    Kind::Number(x) => serde_json::json!(x),
                                    Kind::Text(s) => serde_json::json!(s),
                                    Kind::Bool(b) => serde_json::json!(b),
                                };
                                (k, v)
                            })
                            .collect(),
                    ),
                    Data::SessionEndInfo(end) => {
                        serde_json::json!(["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE"][end.status as usize])
                    }
                };
                hparams.insert(v.tag.clone(), as_json);
                continue;
            }
            match &v.value {
                Some(Value::SimpleValue(x)) => scalars.entry(v.tag.clone()).or_default().push((event.step, *x)),
                Some(Value::Tensor(t)) => text
                    .entry(v.tag.clone())
                    .or_default()
                    .push((event.step, String::from_utf8(t.string_val.concat()).unwrap())),
                None => panic!("a value without data: {v:?}"),
            }
        }
    }
    let series = |kind: &str| -> Series<serde_json::Value> {
        expected[kind]
            .as_object()
            .unwrap()
            .iter()
            .map(|(tag, points)| {
                let points =
                    points.as_array().unwrap().iter().map(|p| (p[0].as_i64().unwrap(), p[1].clone())).collect();
                (tag.clone(), points)
            })
            .collect()
    };
    // TensorBoard stores scalars as float32 and gives them back widened: compare exactly.
    let want_scalars: Series<f32> = series("scalars")
        .into_iter()
        .map(|(t, ps)| (t, ps.into_iter().map(|(s, v)| (s, v.as_f64().unwrap() as f32)).collect()))
        .collect();
    assert_eq!(scalars, want_scalars);
    let want_text: Series<String> = series("text")
        .into_iter()
        .map(|(t, ps)| (t, ps.into_iter().map(|(s, v)| (s, v.as_str().unwrap().to_string())).collect()))
        .collect();
    assert_eq!(text, want_text);
    assert!(scalars.contains_key("lm loss") && scalars.contains_key("iteration-time"), "Megatron's names");
    assert_eq!(serde_json::Value::Object(hparams), expected["hparams"], "the hparams TensorBoard decoded");
    assert_eq!(expected["hparams"]["_hparams_/session_start_info"]["dtype"], "bf16");
    assert_eq!(expected["hparams"]["_hparams_/session_end_info"], "STATUS_SUCCESS");
}
