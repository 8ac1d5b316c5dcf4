// llm-health's monitoring mixin: the rule pack (busy versus hung per engine, the exporter
// layer, the admission edge, GPU faults) and the three dashboards, for kube-prometheus and
// any stack that keeps its alerts as code. See docs/deploy.md, "The monitoring mixin".
local render = import 'lib/render.libsonnet';

(import 'config.libsonnet') + {
  prometheusAlerts+:: { groups+: render.alerts($._config).groups },
  prometheusRules+:: { groups+: render.rules($._config).groups },
  grafanaDashboards+:: render.dashboards($._config),
}
