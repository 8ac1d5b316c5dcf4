-- llm-health's admission door inside nginx (lua-nginx-module, lua-resty-redis): the one
-- decision every door makes, with no process hop. Its plan (the Redis server, routes,
-- keys, budgets and the scripts) is `llm_health_plan.lua`, written by
-- `llm-health nginx-lua --config.file gate.yml`. docs/admission.md, "nginx with Lua".
--
--   init_by_lua_block        { require("llm_health").init(require("llm_health_plan")) }
--   init_worker_by_lua_block { require("llm_health").init_worker() }
--   location / { access_by_lua_block { require("llm_health").access() }
--                body_filter_by_lua_block { require("llm_health").body_filter() }
--                log_by_lua_block { require("llm_health").log() }
--                proxy_hide_header X-Request-Id; proxy_hide_header X-LLM-Health-Decision;
--                proxy_hide_header x-deadline-slack-ms; proxy_hide_header x-queue-age-ms;
--                proxy_pass http://engines; }
--
-- What each phase does, as gate/decision.py does it for the Python doors:
-- access: the allowlist (404/405), the headers (400 naming the header), the body hashed
--   into the retry fingerprint, one EVALSHA of the decision script (store.scripts.DECIDE_LUA,
--   the policy inside it), then the refusal answered (and marked done) or the request
--   passed on with x-queue-age-ms and x-deadline-slack-ms. Redis down: the route's
--   redis_down policy, decided by the same policy code (store.policy) run here.
-- body_filter: the last 4 KiB of the answer, for its `usage`.
-- log: the attempt's end queued; the worker's next decision carries the queued ends
--   (store.ends.DECIDE_ENDS_LUA), else a timer per worker, armed only while ends wait, sends
--   them in one call (ENDS_LUA): 10 ms on after a quiet spell (store.batch's tick), at most
--   100 ms on when the traffic that carried them stops; each idempotent, again while Redis does not answer
--   (0.1, 0.3, 1, 2, 4 s), then given up with a warning in nginx's error log naming the
--   request (its record expires with its retention); an attempt admitted while Redis did
--   not answer in time is finished too, and once more a second after Redis answered.

-- lua-resty-redis: `resty.redis` in OpenResty, `nginx.redis` in Debian's lua-nginx-redis.
local found, redis = pcall(require, "resty.redis")
if not found then redis = require "nginx.redis" end

local M = {}
local plan, pol
local pending, flushing = {}, false
local FLUSH_S = 0.01  -- how long an end waits for a decision to carry it before a timer sends it (store.batch's tick)
-- While decisions carry the ends, the timer looks again this much later: each run of a
-- timer costs nginx a fake request and a coroutine (about an eighth of the door's CPU per
-- request at 500 requests/s when it ran every 10 ms), and the decisions leave it nothing to
-- send. When the traffic stops, what its last answers ended waits this long at most.
local CARRIED_S = 0.1
local armed_at = nil  -- when this worker's ends timer fires (nil: none armed)
local carried = false  -- a decision carried ends since the timer last ran
local arm  -- arm(delay, sooner): a timer that sends the ends due by then (below)
local FINISH_RETRY_S = {0.1, 0.3, 1.0, 2.0, 4.0}
local LATE_RESEND_S = 1.0
local TAIL = 4096
local WEEK, DAY = 7 * 86400 * 1000, 86400 * 1000
local ID_HEADERS = {"X-Request-Id", "Idempotency-Key"}
local RETRY_HEADERS = {"X-Retry-Count", "X-Stainless-Retry-Count", "X-Retry-Attempt"}
local FP_HEADERS = {"Authorization", "Api-Key", "X-Api-Key", "X-Request-Deadline-Ms", "X-Request-Timeout-Ms",
                    "X-Envoy-Expected-Rq-Timeout-Ms", "x-llm-d-inference-ttl"}
local DOWN = {}  -- store.errors.RETRYABLE_CODES, from the plan: one classification for every door

-- ------------------------------------------------------------------ RESP
-- The decision and the ends go to Redis as RESP written here: lua-resty-redis's command
-- methods take five table slots per argument, one of them its length as a number that
-- nginx formats to text twice while it sends the table (8.6% of the door's nginx CPU in a
-- perf profile, bench/notes/bench_admission.md), and a decision that carries its ends has
-- some sixty arguments, most of them the same for every request of a route (its keys, its
-- policy). Those are encoded once, here at init; a request encodes only its own values.
-- lua-resty-redis still connects, authenticates, selects the database and loads scripts.
local function enc(s) return "$" .. #s .. "\r\n" .. s .. "\r\n" end
-- A request's own value as three parts (its length's line, itself, CRLF) that nginx joins as
-- it sends them: no string is made for it here. The new n.
local LEN = setmetatable({}, {__index = function(t, k) local v = "$" .. k .. "\r\n"; t[k] = v; return v end})
local function put(parts, n, s)
  parts[n + 1], parts[n + 2], parts[n + 3] = LEN[#s], s, "\r\n"
  return n + 3
end
local function putd(parts, n, x) return put(parts, n, string.format("%d", x)) end
local function encs(list)
  local out = {}
  for i, v in ipairs(list) do out[i] = enc(v) end
  return table.concat(out)
end
local E0, E1, E2, EMPTY, DONE = enc("0"), enc("1"), enc("2"), enc(""), enc("done")
local E9, E10, L7 = encs({"e", "9", "9"}), encs({"e", "10", "9"}), encs({"l", "7", "7"})  -- an end's kind and counts (store.ends)

function M.init(p)
  plan = p
  for _, code in ipairs(p.down_codes) do DOWN[code] = true end
  -- What every decision sends unchanged, encoded once.
  local q = p.queue
  q.retention_enc = enc(string.format("%d", q.retention_ms))
  q.retention_gc_enc = q.retention_enc .. enc(string.format("%d", q.gc_limit))
  q.record_prefix_enc = enc(q.record_prefix)
  for _, s in pairs(p.scripts) do s.head = encs({"EVALSHA", s.sha}) end
  for _, route in pairs(p.routes) do
    local rk, engine_keys = route.keys, {}
    for _, k in ipairs(route.engine_age) do engine_keys[#engine_keys + 1] = k end
    if #route.engine_age > 0 then
      for _, k in ipairs(route.engine_waiting) do engine_keys[#engine_keys + 1] = k end
      for _, k in ipairs(route.inflight) do engine_keys[#engine_keys + 1] = k end
    end
    route.decide_keys = 7 + #engine_keys  -- the record, the route's five sets, the routes' set, the engines'
    route.decide_keys_enc = encs({rk[1], rk[2], rk[3], rk[4], rk[5], q.routes_key})
    route.engine_keys_enc = encs(engine_keys)
    route.name_enc = enc(route.name)
    route.n_backends_enc = enc(string.format("%d", #route.engine_age))
    route.end_keys_enc = encs({rk[1], rk[2], rk[3], rk[4], rk[5], route.inflight[1], route.inflight[2], route.inflight[3]})
    route.leave_keys_enc = encs({rk[1], rk[2], rk[3], route.inflight[1], route.inflight[2], route.inflight[3]})
    local tail = {}
    for _, a in ipairs(route.policy) do tail[#tail + 1] = a end
    tail[#tail + 1] = "1"  -- the lean reply
    route.decide_tail_enc = encs(tail)
    -- decide_parts' fifteen arguments and this tail are DECIDE_LUA's: the ends carried with a
    -- decision start after them (store.ends.DECIDE_ARGS), so a count that differs is refused here
    assert(15 + #tail == p.decide_args, "llm_health_plan.lua: DECIDE_LUA takes " .. tostring(p.decide_args) .. " arguments: run llm-health nginx-lua again")
  end
  -- The policy (store.policy), for what is decided with no Redis to ask.
  pol = assert(loadstring(p.policy_lua .. "\nreturn {policy = policy, read_policy = read_policy}"))()
end

-- ------------------------------------------------------------------ small pieces

-- One character of `s` at byte i as Python reads a header (UTF-8, surrogateescape): its
-- code point and length, or nil and 1 for a byte that starts no valid sequence.
local function decode(s, i)
  local c = s:byte(i)
  if c < 0x80 then return c, 1 end
  local n, cp, min
  if c >= 0xC2 and c <= 0xDF then n, cp, min = 1, c - 0xC0, 0x80
  elseif c >= 0xE0 and c <= 0xEF then n, cp, min = 2, c - 0xE0, 0x800
  elseif c >= 0xF0 and c <= 0xF4 then n, cp, min = 3, c - 0xF0, 0x10000
  else return nil, 1 end
  for k = 1, n do
    local b = s:byte(i + k)
    if not b or b < 0x80 or b > 0xBF then return nil, 1 end
    cp = cp * 64 + (b - 0x80)
  end
  if cp < min or cp > 0x10FFFF or (cp >= 0xD800 and cp <= 0xDFFF) then return nil, 1 end
  return cp, n + 1
end

-- Python's str.isspace (what .strip() and a str pattern's \s take): ASCII's and Unicode's.
local SPACES = {[0x85] = true, [0xa0] = true, [0x1680] = true, [0x2028] = true, [0x2029] = true, [0x202f] = true, [0x205f] = true, [0x3000] = true}
for cp = 0x2000, 0x200a do SPACES[cp] = true end
for _, b in ipairs({9, 10, 11, 12, 13, 28, 29, 30, 31, 32}) do SPACES[b] = true end

-- str.strip() of a header as Python reads it.
local function strip(s)
  local first, last = s:byte(1), s:byte(-1)
  if first and first > 32 and first < 127 and last > 32 and last < 127 then return s end  -- nothing to strip (most headers)
  if not s:find("[\128-\255]") then return (s:match("^[%s\28-\31]*(.-)[%s\28-\31]*$")) end  -- ASCII: the same set
  local first, last, i = nil, 0, 1
  while i <= #s do
    local cp, len = decode(s, i)
    if not (cp and SPACES[cp]) then
      first = first or i
      last = i + len - 1
    end
    i = i + len
  end
  return first and s:sub(first, last) or ""
end

-- The first n characters of `s` (Python's s[:n]) and how many it has (len(s)).
local function cut(s, n)
  local i, count = 1, 0
  while i <= #s and count < n do
    local _, len = decode(s, i)
    i, count = i + len, count + 1
  end
  return s:sub(1, i - 1)
end
local function chars(s)
  local i, count = 1, 0
  while i <= #s do
    local _, len = decode(s, i)
    i, count = i + len, count + 1
  end
  return count
end

-- What Python's repr escapes beyond ASCII's controls: the non-printable code points it
-- meets in headers (Unicode's spaces, format and private-use characters).
local function unprintable(cp)
  return cp < 0x20 or (cp >= 0x7f and cp <= 0xa0) or cp == 0xad or cp == 0x61c or cp == 0x1680 or cp == 0x180e
    or (cp >= 0x2000 and cp <= 0x200f) or (cp >= 0x2028 and cp <= 0x202f) or (cp >= 0x205f and cp <= 0x206f)
    or cp == 0x3000 or (cp >= 0xe000 and cp <= 0xf8ff) or cp == 0xfeff or (cp >= 0xfff9 and cp <= 0xfffb) or cp >= 0xfffe and cp <= 0xffff
end

-- Each character of `s` through f(code point or nil, its bytes, the byte where invalid).
local function each(s, f)
  local out, i = {}, 1
  while i <= #s do
    local cp, len = decode(s, i)
    out[#out + 1] = f(cp, s:sub(i, i + len - 1), s:byte(i))
    i = i + len
  end
  return table.concat(out)
end

-- Python's repr of a str (the 400s quote what was sent as the gate does).
local function repr(s)
  local q = "'"
  if s:find("'", 1, true) and not s:find('"', 1, true) then q = '"' end
  return q .. each(s, function(cp, bytes, b)
    if cp == nil then return string.format("\\udc%02x", b) end
    if bytes == "\\" then return "\\\\" elseif bytes == q then return "\\" .. q elseif bytes == "\n" then return "\\n"
    elseif bytes == "\r" then return "\\r" elseif bytes == "\t" then return "\\t" end
    if unprintable(cp) then return string.format(cp < 0x100 and "\\x%02x" or "\\u%04x", cp) end
    return bytes
  end) .. q
end

local function json_string(s)
  return '"' .. each(s, function(cp, bytes, b)
    if cp == nil then return string.format("\\udc%02x", b) end
    if bytes == '"' then return '\\"' elseif bytes == "\\" then return "\\\\" elseif bytes == "\n" then return "\\n"
    elseif bytes == "\r" then return "\\r" elseif bytes == "\t" then return "\\t" elseif bytes == "\b" then return "\\b"
    elseif bytes == "\f" then return "\\f" end
    if cp < 0x20 or (cp >= 0x7f and cp < 0x10000) then return string.format("\\u%04x", cp) end
    if cp >= 0x10000 then
      local v = cp - 0x10000
      return string.format("\\u%04x\\u%04x", 0xD800 + math.floor(v / 0x400), 0xDC00 + v % 0x400)
    end
    return bytes
  end) .. '"'
end

-- An object with its keys in order: {{"key", value}, ...}; values: strings, numbers,
-- booleans, ngx.null (null) or such an object.
local function json(pairs_)
  local parts = {}
  for _, kv in ipairs(pairs_) do
    local v, text = kv[2], nil
    if v == ngx.null then text = "null"
    elseif type(v) == "table" then text = json(v)
    elseif type(v) == "string" then text = json_string(v)
    elseif type(v) == "boolean" then text = tostring(v)
    else text = string.format("%d", v) end
    parts[#parts + 1] = json_string(kv[1]) .. ":" .. text
  end
  return "{" .. table.concat(parts, ",") .. "}"
end

local function bad(message) error({bad = message}, 0) end

-- A header name as ngx.req.get_headers keys it (lower case): looked up directly, not
-- through the table's case-folding __index on every request.
local LOWER = setmetatable({}, {__index = function(t, name) local low = name:lower(); t[name] = low; return low end})

-- A header's value; 400 if it came more than once with different values.
local function get(headers, name)
  local v = headers[LOWER[name]]
  if type(v) == "table" then
    local seen, n = {}, 0
    for _, x in ipairs(v) do if not seen[strip(x)] then seen[strip(x)] = true; n = n + 1 end end
    if n > 1 then bad(string.format("%s was sent %d times with different values: the request is ambiguous", name, #v)) end
    return v[1]
  end
  return v
end

local function integer(name, raw, low, high, what)
  local digits = strip(raw):match("^(%d+)$")
  local n = digits and #digits <= 16 and tonumber(digits)
  if not n or n < low or n > high then
    bad(string.format("%s must be %s, an integer from %d to %d, got %s", name, what, low, high, repr(cut(raw, 64))))
  end
  return n
end

local GO_UNITS = {{"ns", 1e-6}, {"us", 1e-3}, {"\194\181s", 1e-3}, {"\206\188s", 1e-3}, {"ms", 1.0}, {"s", 1e3}, {"m", 6e4}, {"h", 3.6e6}}
local function go_duration_ms(name, raw)
  local value = strip(raw)
  if value == "0" then return 0 end
  local function fail() bad(string.format("%s must be a Go duration such as 1500ms or 2s, from 0 to a week, got %s", name, repr(cut(raw, 64)))) end
  if chars(value) > 64 or value == "" then fail() end
  local ms, i = 0, 1
  while i <= #value do
    local num = value:match("^%d+%.?%d*", i) or value:match("^%.%d+", i)
    if not num then fail() end
    i = i + #num
    local unit
    for _, u in ipairs(GO_UNITS) do
      if value:sub(i, i + #u[1] - 1) == u[1] and not (u[1] == "m" and value:sub(i + 1, i + 1) == "s") then unit = u; break end
    end
    if not unit then fail() end
    i = i + #unit[1]
    ms = ms + tonumber(num) * unit[2]
  end
  if ms > WEEK then fail() end
  return math.floor(ms)
end

local function read_request_id(headers)
  for _, name in ipairs(ID_HEADERS) do
    local v = get(headers, name)
    if v ~= nil and strip(v) ~= "" then
      v = strip(v)
      if #v > 256 or not v:match("^[\33-\126]+$") then bad(name .. " must be 1 to 256 printable ASCII characters without spaces") end
      return v
    end
  end
  return nil
end

local function read_tenant(headers)
  local v = get(headers, "X-Tenant")
  local tenant = strip(v == nil and "default" or v)
  if #tenant > 64 or not tenant:match("^[%w_%.:%-]+$") then
    bad("X-Tenant must be 1 to 64 of letters, digits and _ . : -, got " .. repr(cut(tenant, 64)))
  end
  return tenant
end

local function earliest(found, ms) if found == nil or ms < found then return ms end return found end
local BUDGET_HEADERS = {"X-Request-Timeout-Ms", "X-Envoy-Expected-Rq-Timeout-Ms"}

local function read_deadline_ms(headers, now, default_ms)
  local found
  local absolute = get(headers, "X-Request-Deadline-Ms")
  if absolute ~= nil then found = integer("X-Request-Deadline-Ms", absolute, now - DAY, now + WEEK, "Unix time in milliseconds within a week") end
  for _, name in ipairs(BUDGET_HEADERS) do
    local budget = get(headers, name)
    if budget ~= nil then found = earliest(found, now + integer(name, budget, 0, WEEK, "the milliseconds left")) end
  end
  local ttl = get(headers, "x-llm-d-inference-ttl")
  if ttl ~= nil then
    local ms = go_duration_ms("x-llm-d-inference-ttl", ttl)
    if ms > 0 then found = earliest(found, now + ms) end
  end
  if found ~= nil then return found end
  if default_ms == nil then
    bad("no deadline: send X-Request-Deadline-Ms (Unix ms), X-Request-Timeout-Ms (remaining ms) or x-llm-d-inference-ttl, or set the route's default_deadline_ms")
  end
  return now + math.floor(default_ms)
end

local function read_retry_count(headers)
  for _, name in ipairs(RETRY_HEADERS) do
    local v = get(headers, name)
    if v ~= nil then return integer(name, v, 0, 1000, "the attempts before this one") end
  end
  return 0
end

-- ------------------------------------------------------------------ the allowlist

local function raw_ok(path)
  local i = 1
  if path == "" then return false end
  while i <= #path do
    if path:sub(i, i) ~= "/" then return false end
    local _, e = path:find("^[%w_][%w_%.%-]*", i + 1)
    if not e then return false end
    i = e + 1
  end
  return true
end

local function never(path)
  for _, p in ipairs(plan.never) do
    if path == p or path:sub(1, #p + 1) == p .. "/" then return p end
  end
  return nil
end

-- nil where forwarded, else status, reason and the Allow header's methods.
local forwarded, n_forwarded = {}, 0  -- method, path and rule list found forwarded (the few a door sees)
local function not_forwarded(method, path, rules)
  local key = method .. " " .. path
  local seen_rules = forwarded[key]
  if seen_rules and seen_rules[rules] then return nil end
  local methods, seen = {}, {}
  if raw_ok(path) and never(path) == nil then
    for _, r in ipairs(rules) do
      if path:match(r.pattern) and not seen[r.method] then seen[r.method] = true; methods[#methods + 1] = r.method end
    end
  end
  table.sort(methods)
  if #methods == 0 then
    local shown = #path <= 200 and path or path:sub(1, 200) .. "..."
    local why = never(path) and "an engine admin or dev endpoint, never forwarded" or "not an endpoint this route forwards"
    return 404, repr(shown) .. ": " .. why
  end
  if not seen[method:upper()] then
    return 405, string.format("%s %s: only %s is forwarded", method, path, table.concat(methods, ", ")), table.concat(methods, ", ")
  end
  if n_forwarded < 1024 then  -- bounded: not every path a client invents
    if not seen_rules then seen_rules = {}; forwarded[key] = seen_rules; n_forwarded = n_forwarded + 1 end
    seen_rules[rules] = true
  end
  return nil
end

-- ------------------------------------------------------------------ answers

local function answer(status, headers, body)
  ngx.status = status
  for k, v in pairs(headers) do ngx.header[k] = v end
  ngx.header["Content-Type"] = "application/json"
  ngx.print(body)
  return ngx.exit(status)
end

local function error_answer(status, kind, message, headers)
  return answer(status, headers or {}, json({{"error", {{"type", kind}, {"message", message}}}}))
end

-- ------------------------------------------------------------------ Redis

local function connect()
  local r = redis:new()
  r:set_timeout(1000)  -- connect, send and read (lua-resty-redis 0.27, Debian 12: no set_timeouts)
  local ok, err = r:connect(plan.redis.host, plan.redis.port)
  if not ok then return nil, err end
  if r:get_reused_times() == 0 then
    if plan.redis.password then
      local res, aerr
      if plan.redis.username then res, aerr = r:auth(plan.redis.username, plan.redis.password) else res, aerr = r:auth(plan.redis.password) end
      if not res then r:close(); return nil, aerr end
    end
    if plan.redis.db ~= 0 then
      local res, serr = r:select(plan.redis.db)
      if not res then r:close(); return nil, serr end
    end
  end
  return r
end

local function release(r) r:set_keepalive(60000, 64) end

-- An error reply's kind: "down" (a failover's or a restart's answer, or no answer),
-- "noscript", or "answer" (Redis answered, and refused).
local function kind_of(err)
  if err == nil then return nil end
  local text = tostring(err)
  local word = text:match("^(%u+) ") or text:match("^(%u+)$")
  if word == nil then return "down" end  -- no error reply: the connection failed or timed out
  if word == "NOSCRIPT" then return "noscript" end
  if DOWN[word] then return "down" end
  if word == "ERR" and text:lower():find("script", 1, true) then
    -- a failover's code met inside a script, under the script's own error (store.errors._INNER_CODE)
    for inner in text:gmatch("[%s:%-](%u+)") do if DOWN[inner] then return "down" end end
  end
  return "answer"
end

-- One reply: a bulk string, an integer, a status, or false and an error reply's text; nil
-- and the socket's error where none came. (A script's reply here is never an array.)
local function read_reply(sock)
  local line, err = sock:receive()
  if not line then return nil, err end
  local c = line:byte(1)
  if c == 36 then  -- $
    local size = tonumber(line:sub(2))
    if size < 0 then return ngx.null end
    local data, derr = sock:receive(size + 2)
    if not data then return nil, derr end
    return data:sub(1, size)
  elseif c == 58 then return tonumber(line:sub(2))  -- :
  elseif c == 45 then return false, line:sub(2)  -- -
  elseif c == 43 then return line:sub(2) end  -- +
  return nil, "unexpected reply from Redis: " .. line:sub(1, 64)
end

-- EVALSHA, or SCRIPT LOAD and EVALSHA again where the server does not hold the script (a
-- restart, a failover). `parts`: the request from parts[3] on (the number of keys, the
-- keys, the arguments, encoded: see RESP above); `count`: how many arguments they hold.
local function run_call(r, script, parts, count)
  local sock = rawget(r, "_sock")
  if not sock then error("llm-health: this lua-resty-redis keeps no _sock: the door cannot send its script") end
  parts[1], parts[2] = "*" .. (count + 2) .. "\r\n", script.head
  local sent, serr = sock:send(parts)
  if not sent then return nil, serr end
  local res, err = read_reply(sock)
  if res == false and kind_of(err) == "noscript" then
    local loaded, lerr = r:script("load", script.text)
    if not loaded then return loaded, lerr end
    sent, serr = sock:send(parts)
    if not sent then return nil, serr end
    res, err = read_reply(sock)
  end
  return res, err
end

-- Every script loaded, at a worker's start (tried for a minute while Redis does not
-- answer): an EVALSHA that times out in a stall and runs when Redis resumes must find its
-- script there, or the request it records is never recorded.
local function load_scripts(premature, tries)
  if premature then return end
  local r = connect()
  if r then
    local ok = true
    for _, s in pairs(plan.scripts) do
      local res = r:script("load", s.text)
      if not res then ok = false end
    end
    if ok then release(r); return end
    r:close()
  end
  if (tries or 0) < 60 then ngx.timer.at(1, load_scripts, (tries or 0) + 1) end
end

local function now_ms() return math.floor(ngx.now() * 1000) end

local HEX20 = string.rep("%02x", 20)  -- a SHA-1 digest in hex, in one format call

local function random_id()
  local bin = ngx.sha1_bin(ngx.worker.pid() .. ":" .. ngx.now() .. ":" .. math.random() .. ":" .. tostring({}))
  local hex = string.format(HEX20, bin:byte(1, 20))
  return string.format("gate-%s-%s-%s-%s-%s", hex:sub(1, 8), hex:sub(9, 12), hex:sub(13, 16), hex:sub(17, 20), hex:sub(21, 32))
end

-- ------------------------------------------------------------------ the ends

local function tenant_key(tenant)
  return plan.queue.tenant_prefix .. tenant .. ":" .. math.floor(ngx.time() / 60)
end

-- An attempt's end, or a refusal's, queued for Redis: sent with this worker's next
-- decision (DECIDE_ENDS_LUA) or, where no decision came within FLUSH_S, by a timer
-- (ENDS_LUA). The timer is armed only while ends wait: a worker with nothing to send is
-- not woken, and under traffic the decisions carry the ends before it fires.
function M.queue_end(item)
  item.tries, item.at = 0, ngx.now() + FLUSH_S
  pending[#pending + 1] = item
  arm(FLUSH_S, false)
end

-- The queued ends due within `ahead` seconds (a decision: every end not pausing after a
-- failed try; the timer: those due now), at most `most`, taken off the queue (nil where
-- none); `everything`: all of them.
local function take_due(most, everything, ahead)
  if #pending == 0 then return nil end
  local now, due, later = ngx.now() + (ahead or 0), {}, {}
  for _, item in ipairs(pending) do
    if (everything or item.at <= now) and #due < most then due[#due + 1] = item else later[#later + 1] = item end
  end
  pending = later
  if #due == 0 then return nil end
  return due
end

-- Each end's script call appended to `parts` (at n) as store.ends reads it: an attempt's
-- end whole, 'e' (RECORD_ATTEMPT_LUA then LEAVE_QUEUE_LUA: store.ends.attempt_end), or a
-- refusal's, 'l' (LEAVE_QUEUE_LUA); the number of keys, the number of arguments, the keys,
-- the arguments (store.queue.attempt_call and leave_call; the replies are not read); `t`
-- the time they are written. The new n and the number of arguments added.
local function pack_ends(due, t, parts, n)
  local q = plan.queue
  local count = 0
  for _, it in ipairs(due) do
    local route = it.route
    if it.refusal then
      parts[n + 1] = L7
      n = put(parts, n + 1, q.record_prefix .. it.queue_id)
      parts[n + 1] = route.leave_keys_enc
      n = put(parts, n + 1, it.queue_id)
      parts[n + 1] = DONE
      n = putd(parts, n + 1, it.refusal)
      n = put(parts, n, t)
      parts[n + 1], parts[n + 2], parts[n + 3] = E0, E0, E1
      n = n + 3
      count = count + 17
    else
      local units = it.units or 0
      local charged = plan.tenants[it.tenant] and units > 0
      parts[n + 1] = charged and E10 or E9
      n = put(parts, n + 1, q.record_prefix .. it.queue_id)
      parts[n + 1] = route.end_keys_enc
      n = n + 1
      if charged then n = put(parts, n, tenant_key(it.tenant)) end
      n = put(parts, n, it.queue_id)
      n = putd(parts, n, units)
      if it.status then n = putd(parts, n, it.status) else n = n + 1; parts[n] = EMPTY end
      n = put(parts, n, t)
      parts[n + 1] = q.retention_enc
      n = n + 1
      if it.retry_count then n = putd(parts, n, it.retry_count) else n = n + 1; parts[n] = EMPTY end
      n = put(parts, n, it.attempt_id)
      if charged then n = putd(parts, n, units) else n = n + 1; parts[n] = E0 end
      parts[n + 1] = it.status == 499 and E2 or E1
      n = n + 1
      count = count + (charged and 22 or 21)
    end
  end
  return n, count
end

-- After a try: a late attempt once more a second on, the ends not written again after
-- their pause, or given up.
local function settle(due, ok, err)
  for _, it in ipairs(due) do
    if ok then
      if it.late then it.late = false; it.at = ngx.now() + LATE_RESEND_S; pending[#pending + 1] = it; arm(LATE_RESEND_S, true) end
    else
      it.tries = it.tries + 1
      if it.tries > #FINISH_RETRY_S then
        ngx.log(ngx.WARN, "llm-health: gave up recording the attempt of ", it.queue_id, " on route ", it.route.name, ": Redis did not answer (", tostring(err), ")")
      else
        it.at = ngx.now() + FINISH_RETRY_S[it.tries]
        pending[#pending + 1] = it
        arm(FINISH_RETRY_S[it.tries], true)
      end
    end
  end
end

-- ------------------------------------------------------------------ the decision

local function read_body()
  ngx.req.read_body()
  local body = ngx.req.get_body_data()
  if body == nil then
    local file = ngx.req.get_body_file()
    if file then
      local f = io.open(file, "rb")
      if f then body = f:read("*a"); f:close() end
    end
  end
  return body or ""
end

-- `body`: a function that reads the body (only model routing needs it).
local function route_for(headers, body)
  local name = headers["x-route"]
  if type(name) == "table" then name = name[1] end
  if name ~= nil and name ~= "" then
    local route = plan.routes[name]
    if route == nil then bad(string.format("X-Route %s is not a configured route (%s)", repr(name), table.concat(plan.route_order, ", "))) end
    return route
  end
  local first = plan.routes[plan.route_order[1]]
  if #plan.route_order == 1 or not plan.by_model then return first end
  body = body()
  if body:sub(1, 1) ~= "{" then return first end
  local model = body:match('"model"%s*:%s*"([^"\\]*)"')
  if model == nil then return first end
  for _, rname in ipairs(plan.route_order) do
    for _, m in ipairs(plan.routes[rname].models) do if m == model then return plan.routes[rname] end end
  end
  return first
end

local function fingerprint(tenant, route, method, raw_path, headers, body)
  local parts = {tenant, "\0", route.name, "\0", method:upper(), "\0", raw_path, "\0"}
  for _, name in ipairs(FP_HEADERS) do
    local v = headers[LOWER[name]]
    if type(v) == "table" then v = v[1] end
    parts[#parts + 1] = name .. "=" .. (v or "") .. "\0"
  end
  parts[#parts + 1] = "body\0" .. body
  return string.format(HEX20, ngx.sha1_bin(table.concat(parts)):byte(1, 20))
end

-- The decision script's request (store.queue.pipe_decide's keys and arguments, and the
-- lean reply's flag) from parts[3] on: the parts, their last index, the arguments counted.
local function decide_parts(queue_id, route, tenant, deadline_ms, now, fp, retries)
  local q = plan.queue
  local limit = plan.tenants[tenant]
  local nkeys = route.decide_keys + (limit and 1 or 0) + (fp and 1 or 0)
  local parts = {false, false}
  local n = putd(parts, 2, nkeys)
  n = put(parts, n, q.record_prefix .. queue_id)
  parts[n + 1] = route.decide_keys_enc
  n = n + 1
  if limit then n = put(parts, n, tenant_key(tenant)) end
  if fp then n = put(parts, n, q.fp_prefix .. fp) end
  parts[n + 1] = route.engine_keys_enc
  n = n + 1
  -- id, route, tenant, deadline, enqueued, now, retention, gc limit, tenant flag, retry count
  -- with a fingerprint, match_until, the records' prefix, n backends, retry count, budget
  local t = string.format("%d", now)
  n = put(parts, n, queue_id)
  parts[n + 1] = route.name_enc
  n = put(parts, n + 1, tenant)
  n = putd(parts, n, deadline_ms)
  n = put(parts, n, t)
  n = put(parts, n, t)
  parts[n + 1], parts[n + 2] = q.retention_gc_enc, limit and E1 or E0
  n = n + 2
  if fp then
    n = putd(parts, n, retries)
    n = putd(parts, n, deadline_ms + route.retry_match_window_ms)
  else
    parts[n + 1], parts[n + 2] = EMPTY, E0
    n = n + 2
  end
  parts[n + 1], parts[n + 2] = q.record_prefix_enc, route.n_backends_enc
  n = putd(parts, n + 2, retries)
  if limit then n = put(parts, n, string.format("%.17g", limit)) else n = n + 1; parts[n] = EMPTY end
  parts[n + 1] = route.decide_tail_enc
  return parts, n + 1, 1 + nkeys + plan.decide_args
end


local LEAN = "^" .. string.rep("([^\t]*)\t", 11) .. "(.*)$"

-- What the request's headers say (a `bad` error: its 400), or the allowlist's refusal of
-- the route they name.
local function read_request(method, path, headers, now)
  local client_id = read_request_id(headers)
  local route = route_for(headers, read_body)
  local s, why, methods = nil, nil, nil
  if #plan.route_order > 1 then s, why, methods = not_forwarded(method, path, route.allow) end
  if s then return {refused = {s, why, methods}} end
  local tenant = read_tenant(headers)
  local deadline = read_deadline_ms(headers, now, route.default_deadline_ms)
  return {client_id = client_id, route = route, tenant = tenant, deadline = deadline, retries = read_retry_count(headers)}
end

function M.access()
  local method = ngx.req.get_method()
  local raw_path = ngx.var.request_uri
  local path = raw_path:match("^[^?]*")
  local status, reason, allow = not_forwarded(method, path, plan.any_allow)
  if status then return error_answer(status, "not_forwarded", reason, allow and {Allow = allow} or nil) end
  local headers = ngx.req.get_headers(200)
  local now = now_ms()
  local ok, got = pcall(read_request, method, path, headers, now)
  if not ok then
    if type(got) == "table" and got.bad then return error_answer(400, "bad_request", got.bad) end
    error(got)
  end
  if got.refused then
    return error_answer(got.refused[1], "not_forwarded", got.refused[2], got.refused[3] and {Allow = got.refused[3]} or nil)
  end
  local route, tenant, deadline, retries = got.route, got.tenant, got.deadline, got.retries
  local fp, request_id = nil, got.client_id
  if request_id == nil then
    fp = fingerprint(tenant, route, method, raw_path, headers, read_body())
    request_id = random_id()
  end
  local queue_id = tenant .. "/" .. request_id
  local recorded, late, d = true, false, nil
  local age, slack, retry_count, engine_age, wait
  local r, err = connect()
  local res
  if r then
    local parts, n, count = decide_parts(queue_id, route, tenant, deadline, now, fp, retries)
    local ends = take_due(32, false, FLUSH_S)
    if ends then
      carried = true
      -- the ends queued since this worker's last call go with the decision (store.ends)
      local _, added = pack_ends(ends, string.format("%d", now), parts, n)
      res, err = run_call(r, plan.scripts.decide_ends, parts, count + added)
      settle(ends, res ~= nil, err)
    else
      res, err = run_call(r, plan.scripts.decide, parts, count)
    end
  end
  if res then
    -- the lean reply (store.policy's `lean`): the id used, the record's deadline, the
    -- decision, its status, Retry-After, retryable, the figures, the reason
    local used, dl, name, st, after, retryable, a, sl, rc, eng, w, why = res:match(LEAN)
    if used ~= queue_id then queue_id = used; request_id = used:match("^[^/]*/(.*)$") end
    deadline = tonumber(dl)
    d = {decision = name, reason = why, status = tonumber(st), retry_after = tonumber(after), retryable = retryable == "1"}
    age, slack, retry_count, engine_age, wait = tonumber(a), tonumber(sl), tonumber(rc), tonumber(eng), tonumber(w)
  elseif kind_of(err) == "answer" then
    if r then r:close() end
    ngx.log(ngx.ERR, "llm-health: redis refused the request record for route ", route.name, ": ", err)
    return answer(500, {}, json({{"error", {{"type", "internal"}, {"message", "the request could not be recorded"}, {"request_id", request_id}}}}))
  else
    -- Redis down: the route's redis_down policy, decided by the same policy code.
    if r then r:close() end
    recorded, late = false, err == "timeout"
    ngx.log(ngx.WARN, "llm-health: redis unreachable for route ", route.name, " (", tostring(err), "): failing ", route.redis_down)
    slack = deadline - now
    retry_count = retries
    local P = pol.read_policy(route.policy, 1)
    local name, why, st, after, retryable
    if route.redis_down == "closed" then
      name, why, st, after, retryable = "reject_redis_down", "Redis unreachable: queue age unknown; route fails closed", 503, 5.0, true
      local wait_s = math.max(1, math.ceil(after))
      if wait_s * 1000 >= slack then
        why = why .. string.format("; a retry in %d s would come after the deadline (slack %.0f ms): not retryable", wait_s, slack)
        st, after, retryable = P.late_status, nil, false
      end
    else
      name, why, st, after, retryable = pol.policy(P, 0, slack, retries, nil, nil, nil, nil)
      if name == "admit_once" then name, why = "admit_unrecorded", why .. "; Redis unreachable, failing open" end
    end
    d = {decision = name, reason = why, status = st, retry_after = after, retryable = retryable}
  end
  local out = {["X-Request-Id"] = request_id, ["X-LLM-Health-Decision"] = d.decision, ["x-deadline-slack-ms"] = string.format("%d", slack)}
  if age ~= nil then out["x-queue-age-ms"] = string.format("%d", age) end
  if d.decision == "admit_once" or d.decision == "admit_unrecorded" then
    if r then release(r) end
    local slack_ms, age_ms = out["x-deadline-slack-ms"], out["x-queue-age-ms"]
    ngx.req.set_header("X-Request-Id", request_id)
    ngx.req.set_header("X-LLM-Health-Decision", d.decision)  -- the door's, never a client's own
    ngx.req.set_header("x-deadline-slack-ms", slack_ms)
    ngx.req.set_header("x-queue-age-ms", age_ms)
    -- The answer's headers, set now: nginx keeps them through proxy_pass (and on its own 502),
    -- with no header filter phase; the engine's own copies are hidden (proxy_hide_header).
    local h = ngx.header
    h["X-Request-Id"], h["X-LLM-Health-Decision"], h["x-deadline-slack-ms"] = request_id, d.decision, slack_ms
    if age_ms then h["x-queue-age-ms"] = age_ms end
    ngx.ctx.llm_health = {attempt = (recorded or late) and {queue_id = queue_id, route = route, tenant = tenant,
      retry_count = retry_count, attempt_id = string.format("%08x%08x", math.random(0, 0x7fffffff), math.random(0, 0x7fffffff)),
      late = late, deadline = deadline} or nil}
    return
  end
  if recorded then
    -- the refusal's end at once, as an end is written (ENDS_LUA); sent again with the ends
    -- where Redis does not take it now
    local refusal = {queue_id = queue_id, route = route, refusal = d.status}
    local parts = {false, false, E0}
    local _, added = pack_ends({refusal}, string.format("%d", now_ms()), parts, 3)
    local _, lerr = run_call(r, plan.scripts.ends, parts, 1 + added)
    if lerr then
      r:close()
      M.queue_end(refusal)
    else
      release(r)
    end
  elseif late then
    M.queue_end({queue_id = queue_id, route = route, refusal = d.status, late = true})
  end
  if d.retry_after then out["Retry-After"] = string.format("%d", math.max(1, math.ceil(d.retry_after))) end
  out["x-should-retry"] = d.retryable and "true" or "false"
  local err_fields = {{"type", "admission_rejected"}, {"code", d.decision}, {"message", d.reason}, {"retryable", d.retryable}, {"route", route.name}}
  -- the figures decided on (age unknown where Redis did not answer)
  local n = #err_fields
  err_fields[n + 1], err_fields[n + 2] = {"request_id", request_id}, {"queue_age_ms", res and age or ngx.null}
  err_fields[n + 3], err_fields[n + 4] = {"deadline_slack_ms", slack}, {"retry_count", retry_count}
  if res and #route.engine_age > 0 then err_fields[#err_fields + 1] = {"engine_queue_age_ms", engine_age or ngx.null} end
  if res and wait then err_fields[#err_fields + 1] = {"expected_wait_ms", wait} end
  return answer(d.status, out, json({{"error", err_fields}}))
end

-- Nothing: the answer's headers are set in access (a configuration written for an earlier
-- door may still name this phase).
function M.header_filter() end

function M.body_filter()
  local c = ngx.ctx.llm_health
  if c and c.attempt then
    local chunk = ngx.arg[1]
    if chunk and chunk ~= "" then
      local tail = (c.tail or "") .. chunk
      c.tail = #tail > TAIL and tail:sub(-TAIL) or tail
    end
    if ngx.arg[2] then c.eof = true end  -- the answer's last buffer was passed on
  end
end

-- Token units of the answer: `usage.total_tokens` (or prompt + completion) of its last
-- `usage` object (gate.headers.token_units). The objects are found as gmatch would find
-- them ('"usage"%s*:%s*(%b{})', each search resumed after a match's end), but the key is
-- looked for as plain text first: a pattern tried at every byte of the tail cost the
-- door more than the rest of its log phase.
local function token_units(tail)
  local last, init = nil, 1
  while true do
    local s = tail:find('"usage"', init, true)
    if s == nil then break end
    local _, e, obj = tail:find('^"usage"%s*:%s*(%b{})', s)
    if e then last, init = obj, e + 1 else init = s + 1 end
  end
  if last == nil or last:sub(2):find("{", 1, true) then return 0 end
  local total = last:match('"total_tokens"%s*:%s*(%d+)')
  if total then return tonumber(total) end
  return (tonumber(last:match('"prompt_tokens"%s*:%s*(%d+)')) or 0) + (tonumber(last:match('"completion_tokens"%s*:%s*(%d+)')) or 0)
end

function M.log()
  local c = ngx.ctx.llm_health
  if not (c and c.attempt) then return end
  local upstream = (ngx.var.upstream_status or ""):match("([^,]*)$")
  upstream = strip(upstream or "")
  local status = upstream:match("^[1-5]%d%d$") and tonumber(upstream) or tonumber(ngx.var.status)
  -- The client went away before the answer's end (nginx still says the status it began
  -- with): 499, with the token units the answer reported so far, as the gate records it.
  if not c.eof then status = 499 end
  local units = 0
  if status ~= 503 and status ~= 529 and c.tail then units = token_units(c.tail) end
  local a = c.attempt
  a.status, a.units, a.now = status, units, now_ms()
  M.queue_end(a)
  -- A worker shutting down (a reload) runs its timers once, early: what ends after that is
  -- sent by a timer of its own (a zero delay is still allowed then).
  if ngx.worker.exiting() then ngx.timer.at(0, M.flush_exiting) end
end

-- One try at `due`: one ENDS_LUA call (the script's own reply errors, an end Redis refuses,
-- are skipped inside it: what fails here is Redis itself, and the ends are tried again).
local function send(due)
  local r, err = connect()
  if not r then return false, err end
  local parts = {false, false, E0}
  local _, added = pack_ends(due, string.format("%d", now_ms()), parts, 3)
  local res, serr = run_call(r, plan.scripts.ends, parts, 1 + added)
  if res then release(r); return true end
  r:close()
  return false, serr
end

-- One try at the queued ends that are due (`everything`: all of them), at most 256 at once.
local function flush(everything)
  if flushing then return end
  local due = take_due(256, everything)
  if due == nil then return end
  flushing = true
  local ran, ok, err = pcall(send, due)  -- an error here must not stop this worker's recording
  if not ran then ngx.log(ngx.ERR, "llm-health: writing attempt ends failed: ", tostring(ok)); ok, err = false, ok end
  settle(due, ok, err)
  flushing = false
end

-- The worker is exiting (a reload, a stop): what is queued is sent now, each end tried as
-- many times as ever (FINISH_RETRY_S), then given up with its warning.
function M.flush_exiting()
  for _ = 1, #FINISH_RETRY_S + 2 do
    if #pending == 0 then return end
    flush(true)
    if #pending > 0 then ngx.sleep(0.5) end
  end
end

-- The ends timer: what is due is sent; the timer is armed again for the earliest end still
-- waiting. At a worker's exit (a reload) it runs early and sends everything.
local function tick(premature)
  armed_at = nil
  if premature then return M.flush_exiting() end
  local busy = carried
  carried = false
  flush(false)
  local first
  for _, it in ipairs(pending) do if first == nil or it.at < first then first = it.at end end
  if first == nil then return end
  -- decisions carrying the ends: look again later; else when the first is due (a try in flight: not sooner than FLUSH_S)
  if busy then arm(CARRIED_S, true) else arm(math.max(flushing and FLUSH_S or 0.001, first - ngx.now()), true) end
end

-- `sooner`: arm one that fires sooner than the one armed; else arm only where none is.
arm = function(delay, sooner)
  local when = ngx.now() + delay
  if armed_at ~= nil and (not sooner or armed_at <= when) then return end
  if ngx.worker.exiting() then return end  -- log() sends what ends now (flush_exiting)
  local ok, err = ngx.timer.at(delay, tick)
  if ok then armed_at = when else ngx.log(ngx.ERR, "llm-health: could not arm the timer that writes attempt ends: ", err) end
end

function M.init_worker()
  math.randomseed(ngx.now() * 1000 + ngx.worker.pid())
  ngx.timer.at(0, load_scripts, 0)
end

return M
