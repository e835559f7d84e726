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
        let want: BTreeMap<String, HParam> = [
            ("data_path", HParam::text(r#"["a","b"]"#)),
            ("do_sample", HParam::bool(true)),
            ("dtype", HParam::text("bf16")),
            ("gamma", HParam::number(1.0)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        assert_eq!(got, want);
    }
}
