//! Writes the committed TensorBoard fixture (`scripts/make-tensorboard-fixture.sh` runs it, then
//! reads the file back with TensorBoard's own Python reader): a short pretraining-like run's
//! records through the same mapping the steps use, a text summary, and the hparams plugin's
//! session start (three hyperparameters, one of each kind) and end.
//! Usage: tensorboard_fixture DIR

use serde_json::json;
use telemetry::hparams::HParam;
use telemetry::tensorboard::{scalars_of_record, step_of, EventWriter, MEGATRON_TAGS};

fn main() -> anyhow::Result<()> {
    let dir = std::env::args().nth(1).ok_or_else(|| anyhow::anyhow!("usage: tensorboard_fixture DIR"))?;
    let mut writer = EventWriter::create(std::path::Path::new(&dir))?;
    writer.text(0, "flags", "```\nsft --from-scratch --train-iters 3 --enable-tensorboard\n```")?;
    let hparams = [("lr", HParam::number(3e-3)), ("dtype", HParam::text("bf16")), ("do_sample", HParam::bool(true))];
    writer.hparams_start(hparams.into_iter().map(|(k, v)| (k.to_string(), v)).collect())?;
    let records = [
        json!({"iteration": 1, "lm_loss": 10.8125, "lr": 3e-3, "grad_norm": 4.5, "loss_scale": 65536.0, "skipped": false}),
        json!({"iteration": 2, "lm_loss": 9.25, "lr": 1.5e-3, "grad_norm": 3.0, "loss_scale": 65536.0, "skipped": true}),
        json!({"iteration": 3, "lm_loss": 8.0, "lr": 1e-4, "grad_norm": 2.25, "loss_scale": 32768.0, "skipped": false}),
        json!({"iteration": 3, "ms_per_iteration": 125.0, "tokens_per_sec": 2048.0, "rollout": {"reward_mean": -1.5}}),
        json!({"iteration": 3, "valid_loss": 8.5, "valid_ppl": 4914.768840299134}),
    ];
    for record in &records {
        writer.scalars(step_of(record).unwrap_or(0), &scalars_of_record(record, MEGATRON_TAGS))?;
    }
    writer.hparams_end(true)?;
    println!("{}", writer.path().display());
    Ok(())
}
