# The scratch profile behind one_check_profile.txt (2026-12-05 17:25): run from /tmp/sr (where scripts/get_smollm2.py put the
# model) after ut_run.sh ut1 30; it times PublishedModel moving between two kept versions and bare forwards of the fp32 model.
import time, torch, statistics as st
torch.set_num_threads(1)
from pnyx.store import open_store
from pnyx.train.published import PublishedModel
from pnyx.weights.trust import run_verifier
from pnyx.protocol.runfile import read_run
from pnyx.models import resolve_run_model
store = open_store("runs/ut1")
run = read_run(store)
src = resolve_run_model(run.model, "models/SmolLM2-135M-Instruct.Q4_1.gguf", None)
pm = PublishedModel(store, src.folder, keep=4)
pm.trust = run_verifier(run)
with pm.lock:
    for v in (27, 28, 29, 30):
        pm.at(v)   # load them (sync from the store)
    sw = []
    for i in range(6):
        for v in (29, 30):
            t = time.perf_counter(); m = pm.at(v); sw.append(time.perf_counter() - t)
    print("switch between kept versions: median %.3f s" % st.median(sw))
    x = torch.randint(0, 1000, (1, 40))
    fw = []
    with torch.no_grad():
        for i in range(5):
            t = time.perf_counter(); m(input_ids=x); fw.append(time.perf_counter() - t)
    print("forward of 1 row x 40 tokens: median %.3f s" % st.median(fw))
    x = torch.randint(0, 1000, (8, 40))
    fw = []
    with torch.no_grad():
        for i in range(3):
            t = time.perf_counter(); m(input_ids=x); fw.append(time.perf_counter() - t)
    print("forward of 8 rows x 40 tokens: median %.3f s" % st.median(fw))
