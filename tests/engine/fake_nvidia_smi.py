"""A stand-in for `nvidia-smi` in tests (copied as `nvidia-smi` into a folder put first on PATH): one-shot
queries and the `-lms` stream, in the CSV forms the real one prints. The stream's SM clock is read from the file
FAKE_SMI_PHASE names (a test switches it between sections); each line is stamped before that file is read, so a
line stamped after a switch carries the new value. FAKE_SMI_OLD=1: a driver that only knows the "throttle" name
of the clocks-reason field."""
import os
import sys
import time

DETAILS = {"uuid": "GPU-fake-0001", "pci.bus_id": "00000000:19:00.0", "vbios_version": "96.00.99.00.01",
           "clocks.max.sm": "1980 MHz", "clocks.max.memory": "2619 MHz", "power.limit": "700.00 W",
           "enforced.power.limit": "700.00 W", "power.max_limit": "700.00 W", "persistence_mode": "Enabled",
           "ecc.mode.current": "Enabled", "temperature.gpu": "31",
           "name": "NVIDIA H100 80GB HBM3", "driver_version": "580.00", "memory.total": "81559 MiB"}


def main(argv):
    query = next(a.split("=", 1)[1] for a in argv if a.startswith("--query-gpu="))
    fields = query.split(",")
    if os.environ.get("FAKE_SMI_OLD") and "clocks_event_reasons.active" in fields:
        print('Field "clocks_event_reasons.active" is not a valid field to query.', file=sys.stdout)
        return 2
    if "-lms" not in argv:
        print(", ".join(DETAILS.get(f, "0x0000000000000004") for f in fields))
        return 0
    interval = int(argv[argv.index("-lms") + 1]) / 1e3
    phase_file = os.environ["FAKE_SMI_PHASE"]
    n = 0
    while True:
        now = time.time()
        stamp = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
        with open(phase_file) as f:
            sm = f.read().strip() or "0"
        reasons = "0x0000000000000004" if n % 2 else "0x0000000000000000"
        power = "[N/A]" if n % 3 == 2 else f"{300 + n % 5}.00"
        print(f"{stamp}, {sm}, 2619, {power}, {40 + n % 7}, 87, {reasons}", flush=True)
        n += 1
        time.sleep(interval)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
