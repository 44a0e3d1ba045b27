"""HELM executor: plan → stages → tokens → measurements."""
