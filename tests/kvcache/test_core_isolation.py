"""The core stays plain Python: no torch, grpc or protobuf below the servicer."""

import subprocess
import sys


def test_core_imports_no_torch_grpc_or_protobuf():
    code = (
        "import sys, kvserve.kvcache_service.core, kvserve.kvcache_service.core.step;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'grpc', 'google')];"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"core imported {out.stdout.strip()}"
