//! The two wandb endpoints a run uses, over reqwest:
//!
//! - `POST <base>/graphql`, the `upsertBucket` mutation: creates the run (or, with the id of an
//!   existing one, resumes it) with its config, and answers with the entity the run lives in and
//!   how many history lines the service already holds;
//! - `POST <base>/files/<entity>/<project>/<run id>/file_stream`: appends history lines at an
//!   offset, replaces the summary, and finally marks the run complete with its exit code.
//!
//! Both authenticate with HTTP basic auth, user `api`, the API key as the password (what the
//! wandb SDK sends). Errors are sorted into those worth retrying (the service unreachable or too
//! slow; 5xx, 429) and those that are not (the SDK's list: 400, 401, 403, 404, 409, 410, and a
//! GraphQL error).

use serde_json::{json, Value};
use std::time::Duration;

/// What the run's creation sends besides its id.
#[derive(Clone, Debug, PartialEq)]
pub struct RunInfo {
    pub id: String,
    pub project: String,
    /// `None`: the API key's default entity (the service says which in its answer).
    pub entity: Option<String>,
    pub display_name: String,
    pub group: Option<String>,
    /// The run's flags, as wandb's config: `{"flag": {"value": v, "desc": null}}`.
    pub config: serde_json::Map<String, Value>,
    pub host: String,
}

/// The service's answer to the run's creation.
#[derive(Clone, Debug, PartialEq)]
pub struct Bucket {
    pub entity: String,
    pub project: String,
    /// History lines the service holds for the run (0 for a new run).
    pub history_line_count: u64,
}

#[derive(Debug)]
pub enum ApiError {
    /// No answer: no connection, or none in time. Worth trying again later.
    Unreachable(String),
    /// An answer that asks to try again: 429, 5xx, a body cut short.
    Failed(String),
    /// Trying again gives the same answer (a bad key, no such project, a malformed request).
    Refused(String),
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ApiError::Unreachable(m) | ApiError::Failed(m) | ApiError::Refused(m) => f.write_str(m),
        }
    }
}

/// The statuses the wandb SDK does not retry.
pub fn is_refusal(status: u16) -> bool {
    matches!(status, 400 | 401 | 403 | 404 | 409 | 410)
}

/// The wait before retry number `attempt` (0 first): doubling from `base`, at most `max`.
pub fn backoff(attempt: u32, base: Duration, max: Duration) -> Duration {
    base.saturating_mul(1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX)).min(max)
}

/// The GraphQL mutation that creates or resumes a run (the SDK's `UpsertBucket`, the fields this
/// client uses).
pub const UPSERT_BUCKET: &str = "mutation UpsertBucket($id: String, $name: String, $project: String, $entity: String, \
$groupName: String, $displayName: String, $config: JSONString, $host: String, $program: String) { \
upsertBucket(input: {id: $id, name: $name, modelName: $project, entityName: $entity, groupName: $groupName, \
displayName: $displayName, config: $config, host: $host, jobProgram: $program}) { \
bucket { id name displayName historyLineCount project { name entity { name } } } inserted } }";

/// One file_stream request's body: `lines` appended to the history at `offset`, the summary
/// replaced by `summary` (when given).
pub fn file_stream_body(offset: u64, lines: &[String], summary: Option<&Value>) -> Value {
    let mut files = serde_json::Map::new();
    if !lines.is_empty() {
        files.insert("wandb-history.jsonl".into(), json!({"offset": offset, "content": lines}));
    }
    if let Some(summary) = summary {
        files.insert("wandb-summary.json".into(), json!({"offset": 0, "content": [summary.to_string()]}));
    }
    json!({ "files": files })
}

/// The last request of a run: it is finished, with this exit code.
pub fn complete_body(exit_code: i32) -> Value {
    json!({"complete": true, "exitcode": exit_code})
}

pub struct Api {
    client: reqwest::blocking::Client,
    base_url: String,
    api_key: String,
}

impl Api {
    /// A client of the service at `base_url` (`https://api.wandb.ai`) whose every request gives
    /// up after `timeout`.
    pub fn new(base_url: &str, api_key: &str, timeout: Duration) -> Result<Self, ApiError> {
        let client = reqwest::blocking::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .user_agent(concat!("rlhf-rs/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| ApiError::Refused(format!("cannot make an HTTP client: {e}")))?;
        Ok(Self { client, base_url: base_url.trim_end_matches('/').to_string(), api_key: api_key.to_string() })
    }

    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// Creates the run, or resumes the run with this id.
    pub fn upsert_run(&self, run: &RunInfo) -> Result<Bucket, ApiError> {
        let config = Value::Object(run.config.clone()).to_string();
        let body = json!({
            "query": UPSERT_BUCKET,
            "variables": {
                "name": run.id, "project": run.project, "entity": run.entity, "groupName": run.group,
                "displayName": run.display_name, "config": config, "host": run.host, "program": "rlhf-rs",
            },
        });
        bucket_of(&self.post(&format!("{}/graphql", self.base_url), &body)?)
    }

    /// Sends one file_stream request of the run `id` in `bucket`.
    pub fn file_stream(&self, bucket: &Bucket, id: &str, body: &Value) -> Result<(), ApiError> {
        let url = format!("{}/files/{}/{}/{id}/file_stream", self.base_url, bucket.entity, bucket.project);
        self.post(&url, body).map(drop)
    }

    fn post(&self, url: &str, body: &Value) -> Result<Value, ApiError> {
        let response = self
            .client
            .post(url)
            .basic_auth("api", Some(&self.api_key))
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.to_string())
            .send()
            .map_err(|e| ApiError::Unreachable(format!("cannot reach {url}: {}", error_chain(&e))))?;
        let status = response.status().as_u16();
        let text = response.text().map_err(|e| ApiError::Failed(format!("{url}: answer cut short: {e}")))?;
        let excerpt: String = text.chars().take(200).collect();
        match status {
            200..=299 => Ok(serde_json::from_str(&text).unwrap_or(Value::Null)),
            s if is_refusal(s) => Err(ApiError::Refused(format!("{url} answered HTTP {s}: {excerpt}"))),
            s => Err(ApiError::Failed(format!("{url} answered HTTP {s}: {excerpt}"))),
        }
    }
}

/// The run's bucket in the service's answer to `upsertBucket`; its GraphQL errors, or an answer
/// without the project, as a refusal (retrying would get the same answer).
fn bucket_of(answer: &Value) -> Result<Bucket, ApiError> {
    if let Some(errors) = answer.get("errors").filter(|e| e.as_array().is_some_and(|a| !a.is_empty())) {
        return Err(ApiError::Refused(format!("the service refused to create the run: {errors}")));
    }
    let bucket = &answer["data"]["upsertBucket"]["bucket"];
    let text = |v: &Value| v.as_str().map(str::to_string);
    let (Some(entity), Some(project)) = (text(&bucket["project"]["entity"]["name"]), text(&bucket["project"]["name"]))
    else {
        return Err(ApiError::Refused(format!("the service's answer names no project and entity: {answer}")));
    };
    let history_line_count = bucket["historyLineCount"].as_u64().unwrap_or(0);
    Ok(Bucket { entity, project, history_line_count })
}

/// reqwest's error with its causes ("error sending request: connection refused").
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text = format!("{text}: {s}");
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_its_cap_and_the_sdks_refusals_are_not_retried() {
        let (base, max) = (Duration::from_millis(500), Duration::from_secs(30));
        let waits: Vec<u128> = (0..8).map(|a| backoff(a, base, max).as_millis()).collect();
        assert_eq!(waits, [500, 1000, 2000, 4000, 8000, 16000, 30000, 30000]);
        assert_eq!(backoff(1000, base, max), max);
        for s in [400, 401, 403, 404, 409, 410] {
            assert!(is_refusal(s), "{s}");
        }
        for s in [408, 429, 500, 502, 503, 504] {
            assert!(!is_refusal(s), "{s}");
        }
    }

    #[test]
    fn a_file_stream_body_holds_the_lines_at_their_offset_and_the_summary_as_one_line() {
        let lines = vec![r#"{"_step":3,"loss":1.5}"#.to_string()];
        let body = file_stream_body(7, &lines, Some(&json!({"loss": 1.5})));
        assert_eq!(
            body,
            json!({"files": {
                "wandb-history.jsonl": {"offset": 7, "content": [r#"{"_step":3,"loss":1.5}"#]},
                "wandb-summary.json": {"offset": 0, "content": [r#"{"loss":1.5}"#]},
            }})
        );
        assert_eq!(file_stream_body(0, &[], None), json!({"files": {}}));
        assert_eq!(complete_body(3), json!({"complete": true, "exitcode": 3}));
    }

    #[test]
    fn the_bucket_is_read_from_the_answer_and_graphql_errors_are_a_refusal() {
        let answer = |errors: Value| {
            json!({"errors": errors, "data": {"upsertBucket": {"bucket": {
                "historyLineCount": 12, "project": {"name": "proj", "entity": {"name": "ent"}}}}}})
        };
        let want = Bucket { entity: "ent".into(), project: "proj".into(), history_line_count: 12 };
        // No errors, or an empty list of them (as some GraphQL servers send), is the bucket.
        assert_eq!(bucket_of(&answer(Value::Null)).unwrap(), want);
        assert_eq!(bucket_of(&answer(json!([]))).unwrap(), want);
        let refused = |answer: &Value| match bucket_of(answer) {
            Err(ApiError::Refused(m)) => m,
            other => panic!("a refusal: {other:?}"),
        };
        let m = refused(&answer(json!([{"message": "project is archived"}])));
        assert!(m.contains("refused to create the run") && m.contains("project is archived"), "{m}");
        let m = refused(&json!({"data": {"upsertBucket": {"bucket": {"project": {"name": "proj"}}}}}));
        assert!(m.contains("names no project and entity"), "{m}");
        // A new run's bucket may leave the count out: no line yet.
        let new = json!({"data": {"upsertBucket": {"bucket": {"project": {"name": "p", "entity": {"name": "e"}}}}}});
        assert_eq!(bucket_of(&new).unwrap().history_line_count, 0);
    }

    #[test]
    fn an_error_is_written_with_each_of_its_causes() {
        #[derive(Debug)]
        struct Layer(&'static str, Option<Box<Layer>>);
        impl std::fmt::Display for Layer {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.0)
            }
        }
        impl std::error::Error for Layer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                self.1.as_deref().map(|e| e as _)
            }
        }
        let inner = Layer("tcp connect error", Some(Box::new(Layer("Connection refused (os error 111)", None))));
        let e = Layer("error sending request", Some(Box::new(inner)));
        assert_eq!(error_chain(&e), "error sending request: tcp connect error: Connection refused (os error 111)");
        assert_eq!(error_chain(&Layer("alone", None)), "alone");
    }

    #[test]
    fn the_base_url_is_kept_without_its_trailing_slashes() {
        let api = Api::new("http://127.0.0.1:8080//", "k", Duration::from_secs(1)).unwrap();
        assert_eq!(api.base_url(), "http://127.0.0.1:8080");
    }
}
