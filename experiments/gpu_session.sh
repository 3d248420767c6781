source scripts/gpu_env.sh
O=$OUT/r; mkdir -p $O
mkdir -p /tmp/site; python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/nanobind-*.whl 2>&1 | tail -2
PYTHONPATH=/tmp/site:$PYTHONPATH VQPIPE_EXT_BUILD=/tmp/ext_build bash scripts/build_ext.sh "$(command -v python3)" 2>&1 | tail -2
echo "== trellis and ext tests $(date +%T)"
timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE -p no:randomly -n 8 tests/test_trellis_ext.py tests/test_ext.py 2>&1 | tee $O/tests.log | tail -8
echo "== done $(date +%T)"
