"""The Grafana dashboard and its capture under load.

``dashboard``  the panels, once: Grafana's JSON (``docs/observability/grafana.json``)
``capture``    serve, load, scrape with a real Prometheus, render the panels to a PNG
"""
