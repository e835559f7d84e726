//! TensorBoard's hparams plugin (its HPARAMS tab): a run's configuration as its session's
//! hyperparameters, and the session's end. The messages of TensorBoard's
//! `tensorboard/plugins/hparams/{plugin_data,api}.proto` that a run writes (TensorFlow's
//! `hp.hparams` writes the same two); the plugin takes the run's scalars as its metrics.

use prost::Message;
use std::collections::BTreeMap;

/// The plugin's name in a summary's metadata, and the tags of the two summaries.
pub const PLUGIN_NAME: &str = "hparams";
pub const SESSION_START_TAG: &str = "_hparams_/session_start_info";
pub const SESSION_END_TAG: &str = "_hparams_/session_end_info";

/// `tensorboard.hparams.HParamsPluginData` (version 0).
#[derive(Clone, PartialEq, Message)]
pub struct HParamsPluginData {
    #[prost(int32, tag = "1")]
    pub version: i32,
    #[prost(oneof = "Data", tags = "3, 4")]
    pub data: Option<Data>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Data {
    #[prost(message, tag = "3")]
    SessionStartInfo(SessionStartInfo),
    #[prost(message, tag = "4")]
    SessionEndInfo(SessionEndInfo),
}

/// `tensorboard.hparams.SessionStartInfo`: the hyperparameters by name.
#[derive(Clone, PartialEq, Message)]
pub struct SessionStartInfo {
    #[prost(btree_map = "string, message", tag = "1")]
    pub hparams: BTreeMap<String, HParam>,
    #[prost(double, tag = "5")]
    pub start_time_secs: f64,
}

/// `tensorboard.hparams.SessionEndInfo`.
#[derive(Clone, PartialEq, Message)]
pub struct SessionEndInfo {
    /// `tensorboard.hparams.Status`: [`STATUS_SUCCESS`] or [`STATUS_FAILURE`].
    #[prost(int32, tag = "1")]
    pub status: i32,
    #[prost(double, tag = "2")]
    pub end_time_secs: f64,
}

/// A run's session as an event file holds it: its hyperparameters, and its end status once it
/// ended.
#[derive(Clone, Debug, PartialEq)]
pub struct Session {
    pub hparams: BTreeMap<String, HParam>,
    pub status: Option<i32>,
}

pub const STATUS_SUCCESS: i32 = 1;
pub const STATUS_FAILURE: i32 = 2;

/// `google.protobuf.Value`, the kinds a flag has: a number, a string or a bool.
#[derive(Clone, PartialEq, Message)]
pub struct HParam {
    #[prost(oneof = "Kind", tags = "2, 3, 4")]
    pub kind: Option<Kind>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Kind {
    #[prost(double, tag = "2")]
    Number(f64),
    #[prost(string, tag = "3")]
    Text(String),
    #[prost(bool, tag = "4")]
    Bool(bool),
}

impl HParam {
    pub fn number(x: f64) -> Self {
        Self { kind: Some(Kind::Number(x)) }
    }
    pub fn text(s: impl Into<String>) -> Self {
        Self { kind: Some(Kind::Text(s.into())) }
    }
    pub fn bool(b: bool) -> Self {
        Self { kind: Some(Kind::Bool(b)) }
    }
}

/// A run configuration of wandb's shape (`{name: {"value": v, ...}}`, [`crate::wandb::flags_config`])
/// as hyperparameters: numbers, strings and bools as such, a list as its JSON text; unset flags
/// and the whole command line (`command`, too long for a column) left out.
pub fn of_config(config: &serde_json::Map<String, serde_json::Value>) -> BTreeMap<String, HParam> {
    use serde_json::Value;
    config
        .iter()
        .filter(|(name, _)| name.as_str() != "command")
        .filter_map(|(name, entry)| {
            let param = match entry.get("value")? {
                Value::Number(n) => HParam::number(n.as_f64()?),
                Value::String(s) => HParam::text(s.clone()),
                Value::Bool(b) => HParam::bool(*b),
                Value::Null => return None,
                list => HParam::text(list.to_string()),
            };
            Some((name.clone(), param))
        })
        .collect()
}

/// The plugin data of a session's start or end, encoded for a summary's metadata.
pub fn plugin_content(data: Data) -> Vec<u8> {
    HParamsPluginData { version: 0, data: Some(data) }.encode_to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_config_becomes_hyperparameters_of_their_kinds() {
        let config = json!({
            "command": {"value": "ppo --gamma 1.0", "desc": null},
            "gamma": {"value": 1.0, "desc": "Discount factor"},
            "do_sample": {"value": true, "desc": null},
            "dtype": {"value": "bf16", "desc": null},
            "data_path": {"value": ["a", "b"], "desc": null},
            "seed": {"value": null, "desc": null},
        });
        let got = of_config(config.as_object().unwrap());
        // Spelled out, not through the constructors the code under test uses.
        let want: BTreeMap<String, HParam> = [
            ("data_path", Kind::Text(r#"["a","b"]"#.into())),
            ("do_sample", Kind::Bool(true)),
            ("dtype", Kind::Text("bf16".into())),
            ("gamma", Kind::Number(1.0)),
        ]
        .into_iter()
        .map(|(k, kind)| (k.to_string(), HParam { kind: Some(kind) }))
        .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn the_constructors_make_their_kinds() {
        assert_eq!(HParam::number(0.5).kind, Some(Kind::Number(0.5)));
        assert_eq!(HParam::text("x").kind, Some(Kind::Text("x".into())));
        assert_eq!(HParam::bool(false).kind, Some(Kind::Bool(false)));
    }

    /// The bytes TensorBoard's own protos give (tensorboard 2.21.0, protobuf 7.36.2:
    /// `HParamsPluginData(version=0, session_end_info=SessionEndInfo(status=STATUS_FAILURE,
    /// end_time_secs=2.0)).SerializeToString()`, and a start with `hparams["lr"].bool_value =
    /// True`). By the wire format: field 4, length 11; in it field 1 varint 2, field 2 the
    /// double 2.0.
    #[test]
    fn plugin_content_is_the_wire_format_tensorboard_reads() {
        let content =
            plugin_content(Data::SessionEndInfo(SessionEndInfo { status: STATUS_FAILURE, end_time_secs: 2.0 }));
        assert_eq!(content, [0x22, 11, 0x08, 2, 0x11, 0, 0, 0, 0, 0, 0, 0, 0x40]);
        let start = plugin_content(Data::SessionStartInfo(SessionStartInfo {
            hparams: [("lr".to_string(), HParam::bool(true))].into(),
            start_time_secs: 0.0,
        }));
        // Field 3, length 10: one map entry (field 1, length 8: key "lr", value {field 4: true}).
        assert_eq!(start, [0x1a, 10, 0x0a, 8, 0x0a, 2, b'l', b'r', 0x12, 2, 0x20, 1]);
    }
}
