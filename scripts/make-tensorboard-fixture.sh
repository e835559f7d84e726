#!/usr/bin/env bash
# Rewrites telemetry/tests/fixtures/tensorboard/: an event file written by our writer
# (telemetry/examples/tensorboard_fixture.rs) and expected.json, what TensorBoard's own Python
# reader (EventAccumulator, tensorboard on PyPI) reads from it. telemetry/tests/tensorboard_fixture.rs
# then checks that our reader reads the same. Needs python3 with venv and network access to PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=telemetry/tests/fixtures/tensorboard
VENV=${TB_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/tensorboard-venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check tensorboard
rm -rf "$OUT" && mkdir -p "$OUT"
cargo run -q --release -p telemetry --example tensorboard_fixture -- "$OUT"
"$VENV/bin/python" - "$OUT" <<'PY'
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
out = sys.argv[1]
acc = EventAccumulator(out, size_guidance={"scalars": 0, "tensors": 0})
acc.Reload()
tags = acc.Tags()
expected = {
    "scalars": {t: [[e.step, e.value] for e in acc.Scalars(t)] for t in sorted(tags["scalars"])},
    "text": {t: [[e.step, b"".join(e.tensor_proto.string_val).decode()] for e in acc.Tensors(t)]
             for t in sorted(tags["tensors"])},
}
# The hparams plugin's summaries as its own protos decode them: the session's hyperparameters
# (google.protobuf.Value as plain JSON) and its end status by name.
from google.protobuf import json_format
from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2
hparams = {}
for tag, content in sorted(acc.PluginTagToContent("hparams").items()):
    data = plugin_data_pb2.HParamsPluginData.FromString(content)
    which = data.WhichOneof("data")
    if which == "session_start_info":
        hparams[tag] = {k: json_format.MessageToDict(v) for k, v in sorted(data.session_start_info.hparams.items())}
    elif which == "session_end_info":
        hparams[tag] = api_pb2.Status.Name(data.session_end_info.status)
with open(f"{out}/expected.json", "w") as f:  # one line per tag
    f.write("{\n" + ",\n".join(
        f' "{kind}": {{\n' + ",\n".join(f"  {json.dumps(t)}: {json.dumps(v)}" for t, v in tags.items()) + "\n }"
        for kind, tags in expected.items()) + ",\n \"hparams\": " + json.dumps(hparams, sort_keys=True) + "\n}\n")
print(f"TensorBoard read {sum(len(v) for v in expected['scalars'].values())} scalars under "
      f"{len(expected['scalars'])} tags and {len(expected['text'])} text summaries")
PY
