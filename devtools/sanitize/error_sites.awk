# Condenses the reports of compute-sanitizer's memcheck, synccheck or initcheck (run with
# --show-backtrace no) into one line per (report, kernel, PC) with its count, plus the count of
# host-API reports; passes the tool's summary lines and calls.py's progress lines through:
#   awk -f devtools/sanitize/error_sites.awk LOG
# A kernel is named up to "_object_at" (the CuTe DSL's mangled arguments follow).
/^========= Host API/ { api++; what = ""; next }
/^========= [A-Z]/ && !/SUMMARY|COMPUTE-SANITIZER|Warning/ {
  what = $0; sub(/^========= /, "", what); next
}
/^=========[ ]+at / && what != "" {
  site = $3; sub(/_object_at_.*\+0x/, "+0x", site)
  reports[what " | " site]++; what = ""; next
}
/SUMMARY|calls.py |errors were skipped|Segmentation/ { print }
END {
  if (api) print "host-API reports " api
  for (r in reports) print "reports " reports[r] " " r
}
