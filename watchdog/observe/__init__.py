"""What people and other systems see: the watchdog's own /metrics (telemetry), Grafana
dashboards as code and annotations, and the HTML/PNG run report."""
