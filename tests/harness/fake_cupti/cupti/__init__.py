"""A stand-in for NVIDIA's cupti-python on machines without a GPU (tests only): the few calls the harness's
monitor makes, with records that tests/harness/fake_cuda_engine.py emits. It lies honestly: it proves the
monitor's protocol, aggregation and bounds, never what a real GPU does (tests/data/monitor for that)."""
