"""A stand-in for the Python backend's metric API (`triton_python_backend_utils.MetricFamily`), recording
what reaches 'the server' and from which thread, for the tests of our metrics. Not a test module (no
test_ prefix): pytest imports it from this folder as the tests do their own modules."""

import threading


class FakePbUtils:
    """Records what reaches 'the server', and from which thread."""

    def __init__(self, fail_first: bool = False):
        self.sent, self.threads, self.fail_first = [], set(), fail_first
        outer = self

        class Metric:
            def __init__(self, labels, **extra):
                self.labels = labels

            def increment(self, value):
                outer.threads.add(threading.current_thread().name)
                if outer.fail_first:
                    outer.fail_first = False
                    raise RuntimeError("server busy")
                outer.sent.append(("inc", self.family, tuple(sorted(self.labels.items())), value))

            def set(self, value):
                outer.sent.append(("set", self.family, tuple(sorted(self.labels.items())), value))

            def observe(self, value):
                outer.threads.add(threading.current_thread().name)
                outer.sent.append(("obs", self.family, tuple(sorted(self.labels.items())), value))

        class MetricFamily:
            COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

            def __init__(self, name, description, kind):
                self.name = name

            def Metric(self, labels, **extra):  # noqa: N802 - pb_utils' name
                m = Metric(labels, **extra)
                m.family = self.name
                return m

        self.MetricFamily = MetricFamily
