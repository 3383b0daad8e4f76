# Condenses compute-sanitizer racecheck output (--racecheck-report hazard --print-limit 0) into
# one line per (hazard type, kernel, read PC, write PC, whether the reading thread is lane 0 of
# its warp) with its count, then passes the tool's summary and exit lines through:
#   compute-sanitizer --tool racecheck ... 2>&1 | awk -f devtools/sanitize/hazard_pairs.awk
/Potential (WAR|RAW|WAW) hazard/ { match($0, /(WAR|RAW|WAW)/); type = substr($0, RSTART, 3) }
/ Read Thread/ {
  match($0, /\([0-9]+,0,0\)/); tid = substr($0, RSTART + 1, RLENGTH - 6) + 0
  match($0, /at [^ ]+\+0x/); kernel = substr($0, RSTART + 3, RLENGTH - 6)
  match($0, /\+0x[0-9a-f]+/); read_pc = substr($0, RSTART, RLENGTH)
  lane0 = (tid % 32 == 0)
}
/ Write Thread/ {
  match($0, /\+0x[0-9a-f]+/)
  pairs[type " " kernel " read" read_pc " write" substr($0, RSTART, RLENGTH) " reader_lane0=" lane0]++
}
/SUMMARY|calls.py |Segmentation|Error: / && !/Potential/ { print }
END { for (p in pairs) print "hazards " pairs[p] " " p }
