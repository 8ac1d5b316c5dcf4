// The mixin's rendering: rules/templates/*.rules.yml.tmpl and the dashboards, as
// rules/generate.py and grafana/generate.py wrote them into ../generated/, with a _config's
// values (derived by derive.libsonnet, the windows' one definition) where `${section.key}`
// stands. Rendered with the defaults they equal the committed rules/*.rules.yml and
// grafana/dashboards/*.json (tests/integration/test_mixin.py holds them equal).

local derive = import 'derive.libsonnet';
local templates = import '../generated/templates.libsonnet';
local dashboards = import '../generated/dashboards.libsonnet';

// The value at a dotted key, or null where there is none.
local lookup(config, dotted) =
  std.foldl(function(node, part) if std.isObject(node) && std.objectHas(node, part) then node[part] else null, std.split(dotted, '.'), config);

// A template's values (../generated/) with the config's where they go: a string cut into
// `{__parts__: [text, {key: section.key}, ...]}` joined with the values (an unknown key is
// an error naming `where`), and each fragment's marker item replaced by the items it
// stands for.
local fill(v, config, where) =
  if std.isArray(v) then std.flattenArrays([
    if std.isObject(x) && std.objectHas(x, '__fragment__') then lookup(config, x.__fragment__)
    else [fill(x, config, where)]
    for x in v
  ])
  else if std.isObject(v) then
    if std.objectHas(v, '__parts__') then std.join('', [
      if std.isString(p) then p
      else
        local value = lookup(config, p.key);
        if value == null || std.isObject(value) || std.isArray(value) then error '%s: ${%s} is not a value of the config' % [where, p.key]
        else derive.text(value)
      for p in v.__parts__
    ])
    else { [k]: fill(v[k], config, where) for k in std.objectFields(v) }
  else v;

// The config with its derived values set (derive.libsonnet).
local derived(config) =
  local engines = [job for job in std.objectFields(config.scrape_intervals) if std.objectHas(templates, job + '.rules.yml')];
  local patch = derive.derive(config, engines);
  config + { [section]+: patch[section] for section in std.objectFields(patch) };

// Every alert gets runbook_url: the runbook's section of that alert (`runbookURLPattern`
// with the alert's name in lower case, the anchor its `## AlertName` heading renders to).
local withRunbook(rule, pattern) =
  if std.objectHas(rule, 'alert') && std.objectHas(rule, 'annotations') then
    rule + { annotations+: { runbook_url: std.format(pattern, std.asciiLower(rule.alert)) } }
  else rule;

local groups(config) =
  local cfg = derived(config);
  std.flattenArrays([
    [
      g + { rules: [withRunbook(r, config.runbookURLPattern) for r in g.rules] }
      for g in fill(templates[name], cfg, 'rules/templates/%s.tmpl' % name).groups
    ]
    for name in std.objectFields(templates)
  ]);

local hasAlert(g) = [r for r in g.rules if std.objectHas(r, 'alert')] != [];

// A dashboard's data source variable, pinned to `datasource` where one is set.
local pinDatasource(v, datasource) =
  if v.type == 'datasource' && datasource != null then v + { current: { text: datasource, value: datasource } } else v;

local dashboard(name, config) =
  local d = fill(dashboards[name], derived(config), 'grafana/dashboards/' + name);
  local opts = config.dashboards;
  d + {
    uid: if std.objectHas(opts.uids, name) then opts.uids[name] else d.uid,
    templating+: { list: [pinDatasource(v, opts.datasource) for v in d.templating.list] },
  };

{
  // Groups with an alert (and the recording rules evaluated with it), and those with none:
  // every group of the rule files, each whole (a record its alert reads stays in its group).
  alerts(config):: { groups: [g for g in groups(config) if hasAlert(g)] },
  rules(config):: { groups: [g for g in groups(config) if !hasAlert(g)] },
  dashboards(config):: { [name]: dashboard(name, config) for name in std.objectFields(dashboards) },
  derived:: derived,
}
