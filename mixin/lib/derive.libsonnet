// The rule pack's derived values: every window that counts samples, from the scrape
// interval of the job it reads, and the route records of the exporter layer. The one
// definition: rules/generate.py runs this file (through the jsonnet Python package) for the
// committed rule files and the dashboards, and the mixin runs it on its _config, so a
// jsonnet user who overrides a scrape interval gets the windows `rules/generate.py --set`
// gives. Pure: a config (rules/config.yaml's shape) and the engine sections in, the values
// to set out, as {section: {key: value}}.
//
// A window's configured value is its floor: it is raised until it spans
// `evidence.still_scrapes` scrapes (stillness: changes, resets) or `evidence.rate_scrapes`
// scrapes (rate, increase). `<job>.evidence_window` is the job's shortest such window (the
// <Job>ScrapeTooSlow warning counts scrapes in it) and `<job>.evidence_samples` the scrapes
// every such window must hold to be evidence: all but one of those it holds at the
// configured interval, and at least `evidence.min_samples`.

local UNITS = { ms: 0.001, s: 1, m: 60, h: 3600, d: 86400 };
local DIGITS = std.stringChars('0123456789');
local NAME_CHARS = std.stringChars('ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:-');

// [window key, what it counts] of an engine section, and of the exporter's.
local STILL = 'still_scrapes', RATE = 'rate_scrapes';
local ENGINE_WINDOWS = [['progress_window', STILL], ['rate_window', RATE]];
// Windows an engine section may have (raised the same way where it has them).
local OPTIONAL_ENGINE_WINDOWS = [['no_output_window', STILL]];
local EXPORTER_WINDOWS = [['restart_loop_window', RATE], ['probe_window', RATE], ['lease_expiry_window', RATE], ['round_errors_window', RATE]];

// Python's str() of a scalar as the generator printed it: whole numbers without a point.
local text(v) =
  if std.isString(v) then v
  else if std.isNumber(v) then (if v == std.floor(v) then std.toString(v) else std.format('%g', v))
  else std.toString(v);

// A Prometheus duration (30s, 5m, 1m30s) in seconds; an error naming `where` otherwise.
local seconds(value, where) =
  local s = std.stripChars(text(value), ' \t\n');
  local c = std.stringChars(s);
  local n = std.length(c);
  // total seconds, or null where the text is not one or more <digits><unit>
  local parse(i, total, num, parts) =
    if i >= n then (if num == '' && parts > 0 then total else null)
    else if std.member(DIGITS, c[i]) then parse(i + 1, total, num + c[i], parts)
    else if num == '' then null
    else
      local unit = if c[i] == 'm' && i + 1 < n && c[i + 1] == 's' then 'ms' else c[i];
      if !std.objectHas(UNITS, unit) then null
      else parse(i + std.length(unit), total + std.parseInt(num) * UNITS[unit], '', parts + 1);
  local total = parse(0, 0, '', 0);
  if total == null then error "%s: '%s' is not a Prometheus duration (30s, 5m, 1h)" % [where, s]
  else if total <= 0 then error "%s: '%s' must be longer than zero" % [where, s]
  else total;

// Seconds as the shortest Prometheus duration: 120 -> 2m, 105 -> 1m45s.
local duration(total) =
  local step(ms, units) =
    if units == [] then ''
    else
      local size = units[0][1];
      (if ms >= size then std.toString(std.floor(ms / size)) + units[0][0] else '')
      + step(if ms >= size then ms % size else ms, units[1:]);
  local out = step(std.floor(total * 1000 + 0.5), [['h', 3600000], ['m', 60000], ['s', 1000], ['ms', 1]]);
  if out == '' then '0s' else out;

local get(o, k, d=null) = if std.isObject(o) && std.objectHas(o, k) then o[k] else d;

local wholeAtLeast2(n) = std.isNumber(n) && n == std.floor(n) && n >= 2;

// A PromQL regex matching exactly these names (RE2, anchored by PromQL; `.` escaped).
local regex(names) = std.join('|', [std.strReplace(n, '.', '\\\\.') for n in names]);

local isName(name) =
  std.isString(name) && std.length(name) >= 1 && std.length(name) <= 128
  && [ch for ch in std.stringChars(name) if !std.member(NAME_CHARS, ch)] == [];

// `routes:` validated, and the exporter layer's route records: `route_rules`, YAML list
// items indented for the template's rules list (rules/generate.py's text), and
// `route_records`, the same rules as values (the mixin's; the template marks their place).
local routeRecords(config) =
  local routes = if get(config, 'routes') != null then config.routes else {};
  local selector = config.selectors.exporter, replicas = config.exporter.replica_labels;
  local one(route) =
    local spec = routes[route], where = 'routes.' + route;
    if !isName(route) then error 'config: %s: a route name uses letters, digits and _ . : - only (at most 128)' % where
    else if !std.isObject(spec) || std.sort(std.objectFields(spec)) != ['backends', 'deadline'] then
      error 'config: %s: needs exactly `deadline` and `backends` (got %s)' % [where, if std.isObject(spec) then std.toString(std.sort(std.objectFields(spec))) else std.type(spec)]
    else
      local limit = seconds(spec.deadline, where + '.deadline');
      local backends = spec.backends;
      if !std.isArray(backends) || backends == [] then error 'config: %s.backends: a non-empty list of the exporter\'s backend names' % where
      else
        local bad = [b for b in backends if !isName(b)];
        if bad != [] then error "config: %s.backends: '%s' is not a backend name (letters, digits and _ . : - only)" % [where, text(bad[0])]
        else if std.length(std.set(backends)) != std.length(backends) then error 'config: %s.backends: a backend is named twice' % where
        else
          local names = std.join(',', backends);
          local head = [
            'label_replace(label_replace(',
            '  min(max without (%s) (llm_backend_queue_age_seconds{%s, backend=~"%s"})),' % [replicas, selector, regex(backends)],
            '  "route", "%s", "", ""), "backends", "%s", "", "")' % [route, names],
          ];
          local deadline = 'label_replace(vector(%s), "route", "%s", "", "")' % [std.format('%g', limit), route];
          {
            text: '- record: route:llm_engine_queue_age_seconds:min\n'
                  + '  # Route %s: the youngest known head among %s.\n' % [route, names]
                  + '  expr: |\n' + std.join('', ['    ' + l + '\n' for l in head])
                  + '- record: route:llm_deadline_seconds:config\n'
                  + '  expr: ' + deadline,
            records: [
              { record: 'route:llm_engine_queue_age_seconds:min', expr: std.join('\n', head) + '\n' },
              { record: 'route:llm_deadline_seconds:config', expr: deadline },
            ],
          };
  if !std.isObject(routes) then error 'config: routes: must be a mapping of route name to {deadline, backends}'
  else
    local all = [one(r) for r in std.objectFields(routes)];
    local textAll = if all == [] then '# No routes in rules/config.yaml (routes:): LLMEngineQueueAgeOverDeadline has nothing to read.' else std.join('\n', [r.text for r in all]);
    { route_rules: std.strReplace(textAll, '\n', '\n      '), route_records: std.flattenArrays([r.records for r in all]) };

// {section: {key: value}}: what derivation sets in `config`; `engines`: the engine sections
// (the jobs of `scrape_intervals:` with a template of their name). Routes are rendered in
// the order of their names (a jsonnet object's fields are sorted).
local derive(config, engines) =
  local intervals = get(config, 'scrape_intervals'), evidence = get(config, 'evidence');
  if !std.isObject(intervals) || !std.isObject(evidence) then error 'config: `scrape_intervals:` and `evidence:` sections are required'
  else
    local badEvidence = [k for k in [STILL, RATE, 'min_samples'] if !wholeAtLeast2(get(evidence, k))];
    if badEvidence != [] then error 'config: evidence.%s must be a whole number of scrapes, at least 2 (got %s)' % [badEvidence[0], std.toString(get(evidence, badEvidence[0]))]
    else if evidence[STILL] <= evidence.min_samples || evidence[RATE] <= evidence.min_samples then
      error 'config: evidence.still_scrapes and rate_scrapes must exceed min_samples (one scrape spare)'
    else
      local missing(job) = [w[0] for w in ENGINE_WINDOWS if !std.isObject(get(config, job)) || !std.objectHas(config[job], w[0])];
      local incomplete = [job for job in engines if missing(job) != []];
      if incomplete != [] then
        error 'config: the engine section `%s:` (rules/templates/%s.rules.yml.tmpl) needs %s' % [incomplete[0], incomplete[0], std.join(', ', missing(incomplete[0]))]
      else
        // [section, key, job, kind]
        local windows = [[job, w[0], job, w[1]] for job in engines for w in ENGINE_WINDOWS]
                        + [[job, w[0], job, w[1]] for job in engines for w in OPTIONAL_ENGINE_WINDOWS if std.objectHas(config[job], w[0])]
                        + [['exporter', w[0], 'exporter', w[1]] for w in EXPORTER_WINDOWS];
        local jobs = std.set([w[2] for w in windows]);
        local every = { [job]: seconds(get(intervals, job), 'scrape_intervals.' + job) for job in jobs };
        local raised = [
          w + [std.max(seconds(config[w[0]][w[1]], w[0] + '.' + w[1]), evidence[w[3]] * every[w[2]])]
          for w in windows
        ];
        local shortest = { [job]: std.foldl(std.min, [r[4] for r in raised if r[2] == job], 1e300) for job in jobs };
        local queueAge(job) =
          local deadline = seconds(config[job].queue_age_deadline, job + '.queue_age_deadline');
          local window = std.max(deadline, 2 * every[job]);
          // The range the guards read (restarts, failed scrapes): the window and one scrape,
          // so that it holds the sample `offset <window>` reads too.
          { queue_age_window: duration(window), queue_age_range: duration(window + every[job]) };
        local sections = std.set([w[0] for w in windows]);
        {
          [section]: { [r[1]]: duration(r[4]) for r in raised if r[0] == section }
                     + (if std.objectHas(shortest, section) then {
                          evidence_window: duration(shortest[section]),
                          evidence_samples: std.max(evidence.min_samples, std.floor(shortest[section] / every[section] + 1e-9) - 1),
                        } else {})
                     + (if std.member(engines, section) && std.objectHas(config[section], 'queue_age_deadline') then queueAge(section) else {})
                     + (if section == 'exporter' then routeRecords(config) else {})
          for section in sections
        };

{
  seconds:: seconds,
  duration:: duration,
  text:: text,
  derive:: derive,
}
