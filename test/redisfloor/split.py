#!/usr/bin/env python3
"""split.py N DUMP...: instructions per message of callgrind dumps of a
redis-server run under valgrind --tool=callgrind --separate-callers=3,
split by command and by where (native, in EXEC, in a script), N messages
per dump. See the package doc in floor.go for how the dumps are made."""
import re, subprocess, sys

def load(path):
    out = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", path],
                         capture_output=True, text=True, check=True).stdout
    fns = {}
    for line in out.splitlines():
        m = re.match(r"\s*([\d,]+) \([^)]*\)\s+\S*?:(\S+) \[", line)
        if m:
            fns[m.group(2)] = fns.get(m.group(2), 0) + int(m.group(1).replace(",", ""))
        m = re.match(r"\s*([\d,]+) \([^)]*\)\s+PROGRAM TOTALS", line)
        if m:
            fns["TOTAL"] = int(m.group(1).replace(",", ""))
    return fns

def pre(fns, prefix):
    """sum of the inclusive costs of the contexts named prefix... (a function
    under given callers); contexts nest, so only exact-depth prefixes."""
    return sum(v for k, v in fns.items() if k.startswith(prefix))

def split(fns):
    r = {}
    r["total"] = fns["TOTAL"]
    r["serverCron (timer, not per message)"] = pre(fns, "serverCron'")
    r["protocol parsing (processMultibulkBuffer)"] = pre(fns, "processMultibulkBuffer'processInputBuffer'")
    pc = pre(fns, "processCommand'processInputBuffer'")
    top = pre(fns, "call'processCommand'")
    r["dispatch (processCommand less call: lookup, checks, MULTI queueing)"] = pc - top
    cmds = 0
    for c in ["multi", "exec", "evalSha", "set", "get", "time"]:
        v = pre(fns, c + "Command'call'processCommand'")
        if v:
            r[c.upper() + " top level (inclusive)"] = v
            cmds += v
    r["call() around top-level commands (stats, propagation)"] = top - cmds
    for where, ctx in [("in EXEC", "call'execCommand'"), ("in script", "call'scriptCall'")]:
        for c in ["set", "pexpiretime", "get", "time"]:
            v = pre(fns, c + "Command'" + ctx)
            if v:
                r["  " + c.upper() + " " + where] = v
    r["  call() around in-EXEC commands"] = pre(fns, "call'2'execCommand'") - sum(
        pre(fns, c + "Command'call'execCommand'") for c in ["set", "pexpiretime"])
    # Static functions of Debian's redis-server 7.0.15 (build id
    # a50d6825e71f1473372299161f75fe50e80452de), named from what they call:
    # 0x141350 luaCreateArray (KEYS and ARGV: lua_pushlstring, lua_rawseti),
    # 0x142a90 luaRedisGenericCommand (redis.call: Lua arguments to Redis
    # objects, scriptCall, the reply to Lua values).
    arrays = pre(fns, "0x0000000000141350'luaCallFunction'")
    r["  KEYS/ARGV into Lua (luaCreateArray)"] = arrays
    body = pre(fns, "lua_pcall'luaCallFunction'")
    r["  script body incl. redis.call (lua_pcall)"] = body
    glue = pre(fns, "0x0000000000142a90'")
    sc = pre(fns, "scriptCall'")
    r["    redis.call glue (Lua args to objects, reply to Lua)"] = glue - sc
    r["    scriptCall less its commands (lookup, ACL, call())"] = sc - sum(
        pre(fns, c + "Command'call'scriptCall'") for c in ["set", "pexpiretime", "get", "time"])
    r["    Lua VM (the script's own code)"] = body - glue
    r["  EVALSHA rest (sha lookup, gc, reply)"] = pre(fns, "evalShaCommand'call'processCommand'") - arrays - body
    r["reading the socket + rest of processInputBuffer"] = pre(fns, "readQueryFromClient'") - pre(fns, "processInputBuffer'readQueryFromClient'")
    r["processInputBuffer rest (resetClient, freeing argv)"] = pre(fns, "processInputBuffer'readQueryFromClient'") - pc - r["protocol parsing (processMultibulkBuffer)"]
    r["beforeSleep (replies written, etc.)"] = pre(fns, "beforeSleep'")
    return r

n = float(sys.argv[1])
for path in sys.argv[2:]:
    fns = load(path)
    print("==", path)
    for k, v in split(fns).items():
        print(f"{v / n / 1000:9.2f}k  {k}")
