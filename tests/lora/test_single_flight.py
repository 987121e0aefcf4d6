"""`SingleFlight`: one holder per key at a time, other keys never held up."""

from __future__ import annotations

import threading
import time

from loraserve.lora.single_flight import SingleFlight


def test_single_flight_runs_one_holder_per_key() -> None:
    flights = SingleFlight()
    inside, most_inside, entered, lock = [0], [0], [0], threading.Lock()
    in_two = threading.Event()

    def hold_one() -> None:
        with flights.hold(1):
            with lock:
                inside[0] += 1
                entered[0] += 1
                most_inside[0] = max(most_inside[0], inside[0])
                first = entered[0] == 1
            if first:  # the others all queue up behind the first holder before it lets go
                deadline = time.monotonic() + 60
                while flights.waiting(1) < 4 and time.monotonic() < deadline:
                    time.sleep(0.001)
            assert in_two.wait(timeout=60)  # key 2 is never held up by key 1
            with lock:
                inside[0] -= 1

    def hold_two() -> None:
        with flights.hold(2):
            in_two.set()

    threads = [threading.Thread(target=hold_one) for _ in range(4)] + [threading.Thread(target=hold_two)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert entered[0] == 4 and most_inside[0] == 1 and len(flights) == 0 and flights.waiting(1) == 0
