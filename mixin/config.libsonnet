// The mixin's _config: every selector, scrape interval, window floor, threshold and route
// deadline of the rule pack (the defaults are rules/config.yaml's, in
// generated/config.libsonnet, with the same section and key names, so a value here is the
// one `rules/generate.py --set section.key=value` sets), the runbook and the dashboards'
// UIDs and data source. Override what you need:
//
//   (import 'llm-health-mixin/mixin.libsonnet') + {
//     _config+:: {
//       scrape_intervals+: { vllm: '60s' },
//       selectors+: { vllm: 'job="vllm-prod"' },
//     },
//   }
//
// Every window that counts samples is derived from its job's scrape interval
// (lib/derive.libsonnet): the window values here are floors.
{
  _config+:: (import 'generated/config.libsonnet') + {
    // Each alert's runbook_url: this with the alert's name in lower case (the anchor of its
    // section in docs/runbook.md). The default is the repository's relative path, as in the
    // committed rule files; point it at your copy, e.g.
    // 'https://github.com/you/llm-health/blob/main/docs/runbook.md#%s'.
    runbookURLPattern: self.runbook_url + '#%s',
    dashboards: {
      // UID per dashboard file (the committed dashboards' by default).
      uids: {
        'admission.json': 'llm-health-admission',
        'fleet.json': 'llm-health-fleet',
        'gpu-pool.json': 'llm-health-gpu-pool',
      },
      // The data source every panel reads (a `datasource` template variable of type
      // prometheus): null lists them all and selects the first; a name or UID pins it.
      datasource: null,
    },
  },
}
