"""The supervisor's pure parts: which failures count once and how totals survive a server restart."""

from backends.deploy.supervisor import MetricsRelay, failure_counts, model_of, parse_metrics

SCRAPE = """# HELP nv_inference_request_failure ...
nv_inference_request_failure{model="kimi_k25_vision",reason="OTHER",version="1"} 4
nv_inference_request_failure{model="kimi_preprocess",reason="BACKEND",version="1"} 3
nv_inference_request_failure{model="moonvit3d",reason="REJECTED",version="1"} 1
nv_inference_request_failure{model="moonvit3d",reason="CANCELED",version="1"} 2
nv_inference_request_success{model="kimi_placeholder",version="1"} 9
kimi_vision_stub_failures_total{kind="invalid_input",model="kimi_placeholder"} 2
"""


def test_failures_come_from_our_counter_and_the_composing_models_only():
    counts = failure_counts(parse_metrics(SCRAPE))
    assert counts == {("kimi_preprocess", "backend"): 3, ("moonvit3d", "rejected"): 1, ("moonvit3d", "cancelled"): 2,
                      ("kimi_placeholder", "invalid_input"): 2}  # the ensemble's double count is left out


def test_totals_survive_a_restart_and_the_private_counter_is_not_republished():
    relay = MetricsRelay("127.0.0.1", 0, "127.0.0.1:9")
    try:
        relay.last = failure_counts(parse_metrics(SCRAPE))
        relay.server_replaced()
        relay.last = {("kimi_preprocess", "backend"): 1}  # the new server's own count starts again
        assert relay.failures()[("kimi_preprocess", "backend")] == 4
        relay.deaths["kimi_preprocess"] += 1
        text = relay.render()  # the fake triton url does not answer: our families only
        assert 'kimi_vision_request_failures_total{model="kimi_preprocess",kind="backend"} 4' in text
        assert 'kimi_vision_stub_deaths_total{model="kimi_preprocess"} 1' in text
        assert "kimi_vision_stub_failures_total" not in text
    finally:
        relay.stop()


def test_instance_names_map_to_models():
    assert model_of("kimi_preprocess_batched_0_1") == "kimi_preprocess_batched"
    assert model_of("moonvit3d_2_0") == "moonvit3d"
